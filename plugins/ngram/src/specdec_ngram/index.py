"""NgramIndex: an incremental n-gram index over a growing token sequence.

For every ``n`` in ``[min_n, max_n]`` the index maps each n-gram to the
positions that followed its occurrences (a hash chain, as zlib keeps one).
Appending a token adds ``max_n - min_n + 1`` entries, so indexing costs O(1)
per token and never rescans the sequence. A lookup tries the last ``max_n``
tokens first and walks down to ``min_n``; among the occurrences of the first
n-gram that occurred before, it extends each match backwards and keeps the
longest, then the most recent.

The module is pure Python and does not import specdec, so it can be reused and
tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class NgramMatch(NamedTuple):
    """Where the end of the sequence occurred before.

    Attributes:
        position: absolute position of the token that followed the earlier
            occurrence (the first token a copy would propose).
        length: how many tokens match, counting backwards from ``position - 1``
            and from the end of the sequence (at least the n that was looked up;
            capped at the index's ``max_extend``).
        n: the n-gram size whose lookup found the match.
    """

    position: int
    length: int
    n: int


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
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise ValueError(f"limit must be None or an integer >= 0, got {limit!r}")
        self.min_n = min_n
        self.max_n = max_n
        self.limit = limit
        self.max_candidates = max_candidates
        self.max_extend = max(max_extend, max_n)
        self._tokens: list[int] = []
        # _tables[n - min_n][ngram] -> positions that followed it, oldest first.
        self._tables: list[dict[tuple[int, ...], list[int]]] = [
            {} for _ in range(max_n - min_n + 1)
        ]
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
        if self.limit is not None and p >= self.limit:
            return
        lo = self.min_n
        hi = min(self.max_n, p)
        for n in range(lo, hi + 1):
            key = tuple(toks[p - n : p])
            table = self._tables[n - lo]
            chain = table.get(key)
            if chain is None:
                table[key] = [p]
            else:
                chain.append(p)
            self.entries += 1

    def extend(self, tokens: Iterable[int]) -> None:
        """Add tokens in order (O(1) each)."""
        for t in tokens:
            self.append(t)

    def clear(self) -> None:
        """Forget every token."""
        self._tokens = []
        for table in self._tables:
            table.clear()
        self.entries = 0

    # -- lookup --------------------------------------------------------------------

    def find(self) -> NgramMatch | None:
        """The best earlier occurrence of the end of the sequence, or ``None``.

        Longest n-gram first (``max_n`` down to ``min_n``); within the first n that
        has occurrences, the longest backwards match, then the most recent.
        """
        toks = self._tokens
        end = len(toks)
        lo = self.min_n
        for n in range(min(self.max_n, end), lo - 1, -1):
            chain = self._tables[n - lo].get(tuple(toks[end - n :]))
            if not chain:
                continue
            best_pos = chain[-1]
            best_len = self._extend_back(best_pos, end, n)
            # Walk older occurrences, most recent first, so ties keep the most recent.
            # As zlib does, a candidate must match the token at distance best_len before
            # it is extended at all: most are rejected in O(1), even inside long runs.
            stop = max(len(chain) - self.max_candidates, 0)
            for k in range(len(chain) - 2, stop - 1, -1):
                if best_len >= self.max_extend:
                    break
                pos = chain[k]
                if pos - 1 - best_len < 0 or toks[pos - 1 - best_len] != toks[end - 1 - best_len]:
                    continue
                length = self._extend_back(pos, end, n)
                if length > best_len:
                    best_pos, best_len = pos, length
            return NgramMatch(best_pos, best_len, n)
        return None

    def _extend_back(self, pos: int, end: int, n: int) -> int:
        # toks[pos - n : pos] == toks[end - n : end] holds already; count further.
        toks = self._tokens
        length = n
        i, j = pos - n - 1, end - n - 1
        cap = self.max_extend
        while length < cap and i >= 0 and toks[i] == toks[j]:
            length += 1
            i -= 1
            j -= 1
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
