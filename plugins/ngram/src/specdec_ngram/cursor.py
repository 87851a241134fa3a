"""CopyCursor: where in the source the output is copying from, kept across edits.

An answer that rewrites a text it was given (a file with an identifier renamed,
a document with a line inserted) copies long runs of the source and departs
from it in short edits. The n-gram index finds the source again only once the
output's last few tokens match it (2 to 4 tokens after each edit), so each edit
costs rounds without a draft. The cursor instead follows the copy token by
token:

- *Aligned*: ``pos`` is the source position whose token the output is expected
  to write next; every committed token that equals it moves ``pos`` on.
- *Diverged*: a committed token differs from the source at ``div``. The output
  tokens from there on (``ins``) are compared with the source after ``div``: as
  soon as the output's last tokens (at least one) equal the source after a
  replaced span of at most ``window`` tokens, the cursor aligns there again
  (tentatively: ``resumed`` counts the tokens since). The longest such run of
  resumed tokens wins, then the shortest edit. A tentative alignment that
  breaks before ``confirm`` tokens is searched again from the same ``div``; one
  that reaches ``confirm`` tokens ends the edit.
- *Learnt edits*: a confirmed edit that replaced source tokens (``old``) by
  other tokens (``new``) is kept as a rule (:class:`EditRule`; an insertion or
  a deletion with a token of context on each side), and :meth:`apply` writes
  ``new`` wherever ``old`` occurs in a copied continuation: an identifier
  renamed everywhere is proposed renamed from its second occurrence on, and
  the block does not break there. Each rule counts how often a block that
  used it was accepted through the replacement (``hits``, and each time the same
  edit is confirmed again) or rejected inside it (``misses``); a rule with more
  misses than hits is not applied.
  This is the "speculative edits" idea (Cursor's blog post on fast apply:
  draft the original text and let the model diverge where it edits) with the
  edit itself learnt from the first occurrence, as a diff is.

The module is pure Python and does not import specdec.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CopyCursor", "EditRule"]


def _contains(seq: tuple[int, ...], part: tuple[int, ...]) -> bool:
    k = len(part)
    return any(seq[i : i + k] == part for i in range(len(seq) - k + 1))


#: An alignment resumed by two tokens is taken after an edit of at most this many
#: tokens (either side), by one token after half as many; a longer edit needs three.
SHORT_EDIT = 4
#: The longest edit (either side) learnt as a rule.
MAX_RULE = 8
#: The most of the run before an edit that a confirmed alignment carries on (so that
#: an alignment confirmed by chance does not outweigh every index match for long).
INHERIT = 32


class EditRule:
    """A learnt edit: ``old`` source tokens written as ``new``, with its record.

    A replacement (source tokens written as others) is kept as it is, wherever it
    occurs; an insertion or a deletion keeps one token of context on each side
    (``context``: the first and last tokens of ``old`` and ``new``, the same in
    both), so that it applies only between the same two tokens."""

    __slots__ = ("old", "new", "context", "hits", "misses")

    def __init__(self, old: tuple[int, ...], new: tuple[int, ...], context: bool = False) -> None:
        self.old = old
        self.new = new
        self.context = context
        self.hits = 0
        self.misses = 0

    @property
    def active(self) -> bool:
        """Applied to continuations: no more misses than hits."""
        return self.misses <= self.hits

    def __repr__(self) -> str:
        return f"EditRule({list(self.old)} -> {list(self.new)}, hits={self.hits}, misses={self.misses})"


class CopyCursor:
    """Follows the output's place in an indexed token sequence (see the module docstring).

    Args:
        tokens: the indexed sequence (the index's own list: read, never written);
            committed tokens are appended to it before :meth:`feed` sees them.
        window: the longest edit searched for, in source tokens replaced and in
            output tokens written instead; once more than ``2 * window + confirm``
            tokens were written since the departure, the place is lost.
        confirm: tokens that must follow a realignment before it counts (and its
            edit is learnt).
        limit: copies come only from positions below it (``None``: anywhere).
        max_rules: the most edit rules kept (the oldest retired one is dropped first,
            else the oldest).
        seat_len: an index match at least this long moves a cursor that is searching
            after an edit (see :meth:`choose`).
        learn: keep confirmed edits as rules (``False``: follow the place only).
    """

    def __init__(
        self,
        tokens: list[int],
        *,
        window: int = 16,
        confirm: int = 4,
        limit: int | None = None,
        max_rules: int = 64,
        seat_len: int = 4,
        learn: bool = True,
    ) -> None:
        self._toks = tokens
        self.seat_len = seat_len
        self.learn = learn
        self.window = window
        self.confirm = confirm
        self.limit = limit
        self.max_rules = max_rules
        self.rules: dict[tuple[int, ...], EditRule] = {}
        self._first: dict[int, list[EditRule]] = {}
        self.realigned = 0  # edits found (tentative alignments made)
        self.confirmed = 0  # edits confirmed
        self.lost = 0  # places lost (an edit longer than the window, or a gap)
        self._clear()

    def _clear(self) -> None:
        self.pos: int | None = None  # the next source position, when aligned
        # tokens matched in a row at this place (across confirmed edits; after an edit
        # that is not confirmed yet, only those since it)
        self.run = 0
        self.div: int | None = None  # where the output departed, while an edit is open
        self.ins: list[int] = []  # the output's tokens since ``div``
        self.resumed = 0  # tokens matched since the tentative alignment
        self._pre = 0  # ``run`` when the output departed
        self.at: int | None = None  # the position of the next token fed

    # -- state ---------------------------------------------------------------------

    @property
    def tentative(self) -> bool:
        """Aligned after an edit that is not confirmed yet."""
        return self.pos is not None and self.div is not None

    def rebind(self, tokens: list[int]) -> None:
        """Follow another sequence (the index was rebuilt): the place is lost, the
        rules stay."""
        self._toks = tokens
        self.lose()

    def choose(self, match: tuple[int, int] | None, at: int) -> bool:
        """Whether to copy from the cursor's place rather than from the index's
        ``match`` (``(position, length)``, or ``None``), the next token being at
        ``at``; re-seats the cursor on the match where the match wins.

        The cursor's place wins while it is aligned and the match is not longer than
        the cursor's run (tokens matched at this place, across edits): right after
        an edit the index knows only the few tokens written since, or a match of
        the new text elsewhere. A match that is longer moves the cursor there,
        unless the cursor has just realigned after an edit (the copy comes from the
        match then, and the cursor settles the edit within ``confirm`` tokens); a
        match of at least ``seat_len`` tokens moves a cursor that is searching
        after an edit, unless it is just past the edit (the search will find that
        place and learn the edit); with no place and no edit open, any match seats
        it."""
        if self.at is not None and self.at != at:
            self.lose()
        if match is None:
            return self.pos is not None
        mpos, mlen = match
        if self.pos is not None:
            if mpos == self.pos:
                return False
            if mlen <= self.run and not self.continuation(1):
                self.lose()  # nothing left to copy from this place
                self.seat(mpos, mlen, at)
                return False
            if mlen <= self.run:
                return True
            if self.tentative:
                return False  # copy from the match; the edit is settled in a few tokens
        elif self.div is not None and (
            mlen < self.seat_len or self.div < mpos <= self.div + self.window
        ):
            # searching after an edit: a short match does not end it, nor one just
            # past the edit (the search finds that place itself, and learns the edit)
            return False
        self.seat(mpos, mlen, at)
        return False

    def seat(self, pos: int, run: int, at: int) -> None:
        """Copy from source position ``pos`` on (a match of ``run`` tokens found by
        the index), the next token fed being at position ``at``."""
        if self.pos == pos and self.at == at:
            return
        self._clear()
        if pos < at and (self.limit is None or pos < self.limit):
            self.pos, self.run, self.at = pos, run, at

    def lose(self) -> None:
        """Forget the place (the rules stay)."""
        if self.pos is not None or self.div is not None:
            self.lost += 1
        self._clear()

    # -- following the output ---------------------------------------------------------

    def feed(self, start: int, committed: Sequence[int]) -> None:
        """Follow the tokens committed at positions ``start ..`` (already indexed)."""
        if self.at is None:
            return
        if start != self.at:
            self.lose()  # a gap or a rewind: the place is unknown
            return
        for t in committed:
            self._step(int(t))
            if self.at is None:
                return
            self.at += 1

    def _step(self, t: int) -> None:
        toks = self._toks
        if self.div is None:  # aligned, no edit open
            assert self.pos is not None
            if toks[self.pos] == t:
                self._advance()
                return
            self.div, self.ins, self._pre, self.pos = self.pos, [t], self.run, None
            self.resumed = 0
            self._search()  # the output may have skipped source tokens (a deletion)
            return
        self.ins.append(t)
        if self.pos is not None and toks[self.pos] == t:
            self.resumed += 1
            self._advance()
            if self.resumed >= self.confirm:
                self._learn(len(self.ins) - self.resumed)
            return
        self._search()

    def _advance(self) -> None:
        assert self.pos is not None and self.at is not None
        self.pos += 1
        self.run += 1
        if self.pos > self.at or (self.limit is not None and self.pos >= self.limit):
            self.lose()  # ran into the output being fed, or past the limit

    def _search(self) -> None:
        """Align the end of ``ins`` with the source after ``div`` (see the module docstring)."""
        assert self.div is not None and self.at is not None
        toks, ins, div = self._toks, self.ins, self.div
        n = len(ins)
        if n > 2 * self.window + self.confirm:
            self.lose()
            return
        top = self.at if self.limit is None else min(self.limit, self.at)
        best_r, best_q = 0, -1
        # q: the source position after the resumed tokens (the source is what comes
        # before the token just fed, at ``at``); r: how many of ins's last tokens equal
        # the source before q (the new span ins[:n - r] at most window long).
        for q in range(div + 1, min(div + self.window + n, top) + 1):
            r = 0
            while r < n and q - 1 - r >= div and toks[q - 1 - r] == ins[n - 1 - r]:
                r += 1
            a, d = n - r, q - r - div  # tokens written instead, source tokens replaced
            if r == 0 or a > self.window or d > self.window:
                continue
            if r < 3 and max(a, d) > SHORT_EDIT * r // 2:
                continue  # one or two tokens are evidence enough only after a short edit
            if r > best_r:
                best_r, best_q = r, q
                if r == n:
                    break  # every token since the departure: nothing can beat it
        if best_r:
            if self.pos is None:
                self.realigned += 1
            self.pos, self.resumed = best_q, best_r
            self.run = best_r  # the run before the edit counts once it is confirmed
            if best_r >= self.confirm:
                self._learn(n - best_r)
            if self.limit is not None and best_q >= self.limit:
                self.lose()  # aligned at the end of what may be copied: nothing to copy
        else:
            self.pos, self.resumed = None, 0

    def _learn(self, a: int) -> None:
        """The edit is confirmed: ``ins[:a]`` replaced the source from ``div`` on
        (see :class:`EditRule`: an insertion or a deletion keeps the source token
        before ``div`` and the first resumed one as context)."""
        assert self.div is not None and self.pos is not None
        div = self.div
        d = self.pos - self.resumed - div
        toks = self._toks
        written = self.ins[:a]
        self.confirmed += 1
        self.run += min(self._pre, INHERIT)
        self.div, self.ins, self.resumed = None, [], 0
        if max(a, d) > MAX_RULE:
            return
        context = not a or not d
        if context:
            if div < 1:
                return
            old = tuple(toks[div - 1 : div + d + 1])
            new = (toks[div - 1], *written, toks[div + d])
        else:
            old, new = tuple(toks[div : div + d]), tuple(written)
        if old == new or not self.learn:
            return
        have = self.rules.get(old)
        if have is not None and have.new == new:
            have.hits += 1  # the same edit again: evidence for it (a retired rule returns)
            return
        if not context and _contains(new, old):
            return  # written again into copies of the edited text, it would repeat
        if have is not None:
            self._drop(old)  # the same tokens edited otherwise: the newer edit counts
        elif len(self.rules) >= self.max_rules:
            # the oldest of the retired rules, else the oldest
            worst = next((o for o, r in self.rules.items() if not r.active), next(iter(self.rules)))
            self._drop(worst)
        rule = EditRule(old, new, context)
        self.rules[old] = rule
        self._first.setdefault(old[0], []).append(rule)

    def _drop(self, old: tuple[int, ...]) -> None:
        rule = self.rules.pop(old)
        first = self._first[old[0]]
        first.remove(rule)
        if not first:
            del self._first[old[0]]

    # -- copying -------------------------------------------------------------------

    def continuation(self, count: int) -> list[int]:
        """Up to ``count`` source tokens from the cursor's place (before :meth:`apply`)."""
        if self.pos is None or self.at is None:
            return []
        stop = self.at if self.limit is None else min(self.limit, self.at)
        return list(self._toks[self.pos : min(stop, self.pos + count)])

    def apply(
        self, prev: int, tokens: Sequence[int], count: int
    ) -> tuple[list[int], list[int], list[tuple[int, EditRule]]]:
        """``tokens`` (which follow the token ``prev``) with every active rule's
        ``old`` written as its ``new``, cut to ``count``; for each token of the
        result, the index in ``tokens`` it stands for (a replacement's tokens: the
        old token at the same offset, or its last); and the replacements made
        (``(offset in the result, rule)``: the offset of the first token after the
        rule's leading context). A rule's context may be ``prev``; a replacement
        never starts at ``prev`` (it is committed)."""
        if not self._first:
            out = list(tokens[:count])
            return out, list(range(len(out))), []
        seq = [prev, *tokens]
        out: list[int] = []
        origin: list[int] = []
        used: list[tuple[int, EditRule]] = []
        i, n = 0, len(seq)
        while i < n and len(out) <= count:
            t = seq[i]
            for rule in self._first.get(t, ()):
                k = len(rule.old)
                c = int(rule.context)  # the trailing context is copied as any token
                if (c or i) and rule.active and tuple(seq[i : i + k]) == rule.old:
                    used.append((len(out) + c - 1, rule))
                    new = rule.new[: len(rule.new) - c]
                    out.extend(new)
                    origin.extend(min(i + j, i + k - 1 - c) for j in range(len(new)))
                    i += k - c
                    break
            else:
                out.append(t)
                origin.append(i)
                i += 1
        # drop ``prev`` (a rule's context token is never replaced)
        return (
            out[1 : count + 1],
            [max(0, o - 1) for o in origin[1 : count + 1]],
            [(o, r) for o, r in used if o < count],
        )

    @staticmethod
    def score(
        used: Sequence[tuple[int, EditRule]], accepted: int, proposed: int
    ) -> tuple[int, int]:
        """Record the outcome of a block that used the replacements ``used``:
        ``accepted`` of its first ``proposed`` tokens were accepted. Returns how many
        replacements were accepted in full and how many were rejected inside
        (the others were not reached)."""
        hits = misses = 0
        for offset, rule in used:
            # ``offset``: the first token after the rule's leading context; the block
            # went through the replacement once its tokens (and its trailing context)
            # were accepted; it was rejected inside it where it was rejected before that
            # end, within the block
            end = offset + len(rule.new) - int(rule.context)
            if end <= proposed and accepted >= end:
                rule.hits += 1
                hits += 1
            elif offset <= accepted < min(end, proposed):
                rule.misses += 1
                misses += 1
        return hits, misses
