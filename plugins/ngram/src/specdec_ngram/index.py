"""NgramIndex: an incremental n-gram index over a growing token sequence.

For every ``n`` in ``[min_n, max_n]`` the index keeps hash chains as zlib does:
``head[key]`` is the most recent position that followed an n-gram with that key
and ``prev[p]`` the one before it. Keys are rolling hashes of the n-gram, so
appending a token costs ``max_n - min_n + 1`` integer updates, allocates no
per-n-gram objects and never rescans the sequence (O(1) per token). A lookup
tries the last ``max_n`` tokens first and walks down to ``min_n``; among the
occurrences of the first n-gram that occurred before, it extends each match
backwards and keeps the longest, then the most recent. Every candidate is
compared token by token, so a hash collision can never produce a wrong match.

Copying a text with a small change (a renamed identifier) is the case that
matters most, so two refinements are on by default:

- *Edits.* Extending a match backwards may step over ``max_edits`` edited
  tokens (a substitution, an insertion or a deletion), so the occurrence that
  is aligned with the source text outscores unrelated ones that only share the
  last few tokens.
- *Realignment.* Right after an edit the last token occurs nowhere in the
  source, so no n-gram matches. The lookup then treats the last token (or the
  last two) as replacing one source token and copies on from the aligned
  position past it.

:meth:`NgramIndex.continuation` copies what followed the chosen occurrence (the
most recent of the best). :meth:`NgramIndex.ranked_continuation` lets every
earlier occurrence that matches about as much context vote instead, as
suffix-tree drafters (SuffixDecoding) pick the most frequent child: the
candidates are the occurrences in the chain of the match's n-gram (at most
``max_candidates``, most recent first) whose backwards match is at least
``min(match.length, floor)`` tokens long (``floor`` defaults to ``max_n``, so an
edit-aligned match is not outvoted by occurrences sharing only a short n-gram,
while ``max_n`` tokens of context count as strong enough evidence). The block is
then built token by token: the surviving candidates vote with the token that
follows them at that offset, the most frequent token wins (ties: the most recent
candidate's), and the candidates that disagree drop out. Each token comes with
its share of the votes, so a branching point (share < 1) is visible and can end
the block early (``min_share``). The cost stays bounded: ``max_candidates``
occurrences, each compared over at most ``floor`` tokens (per edit branch), then
``count`` voting steps over the survivors.

The module is pure Python and does not import specdec, so it can be reused and
tested on its own.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NamedTuple

_MASK = (1 << 64) - 1
_MUL = 0x9E3779B97F4A7C15  # odd: the rolling key is a bijection of the last key


class NgramMatch(NamedTuple):
    """Where the end of the sequence occurred before.

    Attributes:
        position: absolute position of the token that followed the earlier
            occurrence (the first token a copy would propose).
        length: how many tokens match, counting backwards from ``position - 1``
            and from the end of the sequence (at least the n that was looked up;
            capped at the index's ``max_extend``).
        n: the n-gram size whose lookup found the match.
        skipped: 0 for a match that ends at the end of the sequence; 1 or 2 for a
            realigned match: the last ``skipped`` tokens are taken to replace the
            source token before ``position``.
    """

    position: int
    length: int
    n: int
    skipped: int = 0


class NgramIndex:
    """An append-only n-gram index over a token sequence.

    Args:
        min_n: the shortest n-gram looked up.
        max_n: the longest n-gram indexed and looked up.
        limit: when set, only occurrences followed by a token at a position
            ``< limit`` are indexed and copies stop at ``limit`` (``limit`` is
            the prompt length for "prompt only" copying). ``None``: everything.
        max_candidates: how many of the most recent occurrences of an n-gram
            are extended backwards per lookup (bounds the cost of a lookup).
        max_extend: the longest backwards extension measured; matches at least
            this long tie on length and the most recent wins.
        max_edits: edited tokens a backwards extension may step over (0: exact).
        realign: after an edit, copy on from the aligned position (see the module
            docstring).

    Raises:
        ValueError: a bound is not a positive integer or ``min_n > max_n``.
    """

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 8,
        *,
        limit: int | None = None,
        max_candidates: int = 64,
        max_extend: int = 64,
        max_edits: int = 1,
        realign: bool = True,
    ) -> None:
        for label, value in (
            ("min_n", min_n),
            ("max_n", max_n),
            ("max_candidates", max_candidates),
            ("max_extend", max_extend),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"min_n ({min_n}) must be <= max_n ({max_n})")
        if not isinstance(max_edits, int) or isinstance(max_edits, bool) or not 0 <= max_edits <= 2:
            raise ValueError(f"max_edits must be 0, 1 or 2, got {max_edits!r}")
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")
        self.min_n = min_n
        self.max_n = max_n
        self.limit = limit
        self.max_candidates = max_candidates
        self.max_extend = max(max_extend, max_n)
        self.max_edits = max_edits
        self.realign = bool(realign)
        self._tokens: list[int] = []
        # Per n (index n - min_n): head[key] -> most recent following position, and
        # prev[p] -> the previous position whose n-gram had the same key (-1: none).
        self._heads: list[dict[int, int]] = [{} for _ in range(max_n - min_n + 1)]
        self._prevs: list[array] = [array("q") for _ in range(max_n - min_n + 1)]
        self.entries = 0

    # -- building ------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The indexed sequence (do not mutate; use :meth:`append`/:meth:`extend`)."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def append(self, token: int) -> None:
        """Add one token and index the n-grams that it follows."""
        toks = self._tokens
        p = len(toks)
        toks.append(int(token))
        lo = self.min_n
        hi = min(self.max_n, p)
        if self.limit is not None and p >= self.limit:
            hi = lo - 1  # past the limit: keep positions aligned, index nothing
        h = 0
        for k in range(1, self.max_n + 1):
            if k <= hi:
                h = (h * _MUL + toks[p - k] + 1) & _MASK
            if k < lo:
                continue
            i = k - lo
            if k <= hi:
                head = self._heads[i]
                self._prevs[i].append(head.get(h, -1))
                head[h] = p
                self.entries += 1
            else:
                self._prevs[i].append(-1)

    def extend(self, tokens: Iterable[int]) -> None:
        """Add tokens in order (O(1) each)."""
        for t in tokens:
            self.append(t)

    def clear(self) -> None:
        """Forget every token."""
        self._tokens = []
        self._heads = [{} for _ in self._heads]
        self._prevs = [array("q") for _ in self._prevs]
        self.entries = 0

    # -- lookup --------------------------------------------------------------------

    def find(self) -> NgramMatch | None:
        """The best earlier occurrence of the end of the sequence, or ``None``.

        Longest n-gram first (``max_n`` down to ``min_n``); within the first n that
        has occurrences, the longest backwards match (stepping over up to
        ``max_edits`` edits), then the most recent. With ``realign``, a match of the
        sequence without its last token (or last two) that is longer than the
        exact match, and predicts the same next token, wins: see the module
        docstring.
        """
        toks = self._tokens
        end = len(toks)
        match = self._lookup(end)
        if not self.realign or end < 2:
            return match
        stop = end if self.limit is None else min(self.limit, end)
        # The last token replaced the source token at m1.position.
        m1 = self._lookup(end - 1)
        if m1 is not None and toks[m1.position] != toks[end - 1]:
            pos = m1.position + 1
            if pos < stop and (
                match is None or (m1.length > match.length and toks[match.position] == toks[pos])
            ):
                return NgramMatch(pos, m1.length, m1.n, 1)
        # The last two tokens replaced one source token.
        if match is None and m1 is None and end >= 3:
            m2 = self._lookup(end - 2)
            if m2 is not None and toks[m2.position] != toks[end - 2]:
                pos = m2.position + 1
                if pos < stop:
                    return NgramMatch(pos, m2.length, m2.n, 2)
        return match

    def _lookup(self, end: int) -> NgramMatch | None:
        # The best earlier occurrence of the suffix of toks[:end].
        toks = self._tokens
        lo = self.min_n
        top = min(self.max_n, end)
        keys = []
        h = 0
        for k in range(1, top + 1):
            h = (h * _MUL + toks[end - k] + 1) & _MASK
            keys.append(h)
        cap = self.max_extend
        for n in range(top, lo - 1, -1):
            pos = self._heads[n - lo].get(keys[n - 1], -1)
            prev = self._prevs[n - lo]
            best_pos = best_len = -1
            # Walk the chain from the most recent occurrence, so ties keep the most
            # recent. As zlib does, a candidate must match a token near distance
            # best_len (allowing for the edits) before it is compared in full:
            # most are rejected in O(1), even inside long runs of one token.
            for _ in range(self.max_candidates):
                if pos < 0:
                    break
                if pos < end and (best_len < 0 or self._may_beat(pos, end, best_len)):
                    length = self._match_len(pos, end, n)
                    if length > best_len:
                        best_pos, best_len = pos, length
                        if length >= cap:
                            break
                pos = prev[pos]
            if best_len >= 0:
                return NgramMatch(best_pos, best_len, n)
        return None

    def _may_beat(self, pos: int, end: int, best: int) -> bool:
        # A necessary condition for a match longer than ``best``: among the history
        # tokens at distances best .. best + edits, one that is not an edit lines
        # up with the candidate at an offset of at most ``edits``.
        toks = self._tokens
        e = self.max_edits
        for k in range(best, best + e + 1):
            j = end - 1 - k
            if j < 0:
                return False
            t = toks[j]
            for s in range(-e, e + 1):
                i = pos - 1 - k + s
                if 0 <= i < j and toks[i] == t:
                    return True
        return False

    def _match_len(self, pos: int, end: int, n: int) -> int:
        # Tokens before ``pos`` matching those before ``end``: the n-gram exactly
        # (else the hit was a hash collision: -1), then up to max_edits edits.
        toks = self._tokens
        if toks[pos - n : pos] != toks[end - n : end]:
            return -1
        return n + self._extend(pos - n - 1, end - n - 1, self.max_edits, self.max_extend - n)

    def _extend(self, i: int, j: int, edits: int, cap: int) -> int:
        toks = self._tokens
        length = 0
        # i < j: a candidate never matches against itself.
        while length < cap and 0 <= i < j:
            if toks[i] == toks[j]:
                length += 1
                i -= 1
                j -= 1
                continue
            if edits == 0:
                break
            rest = cap - length
            return length + max(
                self._extend(i - 1, j - 1, edits - 1, rest),  # substitution
                self._extend(i, j - 1, edits - 1, rest),  # a token inserted in the history
                self._extend(i - 1, j, edits - 1, rest),  # a source token deleted
            )
        return length

    def continuation(self, match: NgramMatch, count: int) -> list[int]:
        """Up to ``count`` tokens predicted to follow the sequence, copied from ``match``.

        Copying may run into the copy itself (as LZ77 does) when the match is a
        repeat close to the end: ``a b a b`` continues ``a b a b ...``. With a
        ``limit``, copying stops at the limit.
        """
        toks = self._tokens
        end = len(toks)
        stop = end if self.limit is None else min(self.limit, end)
        out: list[int] = []
        pos = match.position
        for j in range(count):
            src = pos + j
            if src < stop:
                out.append(toks[src])
            elif self.limit is None:
                out.append(out[src - end])  # src - end < j: a token already proposed
            else:
                break
        return out

    def ranked_continuation(
        self,
        match: NgramMatch,
        count: int,
        *,
        min_share: float = 0.0,
        floor: int | None = None,
    ) -> tuple[list[int], list[float]]:
        """Up to ``count`` tokens chosen by the votes of every occurrence like ``match``.

        Candidates: the occurrences in the hash chain of the last ``match.n``
        tokens (the ``max_candidates`` most recent) whose backwards match, measured
        as :meth:`find` measures it (edits included), is at least
        ``min(match.length, floor)`` tokens long; ``floor=None`` means ``max_n``.
        ``match.position`` itself always counts. At step ``j`` each surviving
        candidate votes with the token at its offset ``j`` (copying may run into
        the copy itself as :meth:`continuation` does; with a ``limit`` a candidate
        that reaches it stops voting). The most frequent token wins, a tie goes to
        the most recent candidate among the tied tokens, and the candidates that
        voted otherwise drop out. ``shares[j]`` is the winner's share of the votes
        at step ``j`` (1.0 when all agree). The block goes on through a branching
        point with the winner; with ``min_share > 0`` it stops before the first
        token whose share is below ``min_share`` (the first token is always kept).
        A realigned match (``match.skipped > 0``) returns the plain
        :meth:`continuation` with shares of 1.0.

        Returns:
            ``(tokens, shares)``, two lists of the same length (at most ``count``).

        Raises:
            ValueError: ``min_share`` is not in ``[0, 1]`` or ``floor`` is not
                ``None`` or an integer >= 1.
        """
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        if floor is not None and (
            not isinstance(floor, int) or isinstance(floor, bool) or floor < 1
        ):
            raise ValueError(f"floor must be None or an integer >= 1, got {floor!r}")
        if count <= 0:
            return [], []
        if match.skipped:
            plain = self.continuation(match, count)
            return plain, [1.0] * len(plain)
        toks = self._tokens
        end = len(toks)
        stop = end if self.limit is None else min(self.limit, end)
        self_copy = self.limit is None
        alive = self._candidates(match, self.max_n if floor is None else floor)
        out: list[int] = []
        shares: list[float] = []
        for j in range(count):
            # Votes in recency order: the dict keeps the order in which tokens first
            # appear, and max() returns the first of equal counts, so ties go to the
            # most recent candidate.
            votes: dict[int, int] = {}
            voters: list[tuple[int, int]] = []
            for c in alive:
                src = c + j
                if src < stop:
                    t = toks[src]
                elif self_copy:
                    t = out[src - end]  # src - end < j: a token already chosen
                else:
                    continue  # reached the limit: no more votes from this one
                voters.append((c, t))
                votes[t] = votes.get(t, 0) + 1
            if not voters:
                break
            best = max(votes, key=votes.__getitem__)
            share = votes[best] / len(voters)
            if j and share < min_share:
                break
            out.append(best)
            shares.append(share)
            if len(voters) != len(alive) or len(votes) > 1:
                alive = [c for c, t in voters if t == best]
        return out, shares

    def _candidates(self, match: NgramMatch, floor: int) -> list[int]:
        # Positions (most recent first) of the occurrences in the chain of the last
        # match.n tokens whose backwards match reaches min(match.length, floor).
        toks = self._tokens
        end = len(toks)
        n = match.n
        pos0 = match.position
        if not self.min_n <= n <= self.max_n or n > end:
            return [pos0]
        need = min(match.length, floor)
        h = 0
        for k in range(1, n + 1):
            h = (h * _MUL + toks[end - k] + 1) & _MASK
        pos = self._heads[n - self.min_n].get(h, -1)
        prev = self._prevs[n - self.min_n]
        suffix = toks[end - n : end]
        found: list[int] = []
        for _ in range(self.max_candidates):
            if pos < 0:
                break
            # The n-gram exactly (a hash collision fails here), then the extension,
            # capped at what it needs to reach: O(floor) per candidate.
            if pos == pos0 or (
                pos < end
                and toks[pos - n : pos] == suffix
                and n + self._extend(pos - n - 1, end - n - 1, self.max_edits, need - n) >= need
            ):
                found.append(pos)
            pos = prev[pos]
        if pos0 not in found:  # a match from before the index grew: it still counts
            found.append(pos0)
            found.sort(reverse=True)
        return found
