"""NgramCopyDrafter: proposes what followed the last occurrence of the recent tokens.

A copy drafter for models without a draft head. When an answer copies text it
was given (rewriting a file with a small change, quoting passages), the last few
committed tokens occurred before in the context, and what followed there is a
good guess for what comes next. Drafts are deterministic (``Draft.probs`` is
``None``), so greedy output stays token-identical to plain decoding and sampled
output keeps the target's distribution (point-mass acceptance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import specdec
from specdec import BaseDrafter, BaseDrafterSession, Draft, RequestContext, RoundResult

from .index import NgramIndex, NgramMatch

NAME = "ngram_copy"

SOURCES = ("all", "prompt")

#: Default options of ``ngram_copy`` (see the README for what each one does).
DEFAULTS: Mapping[str, Any] = {
    "source": "all",
    "min_n": 2,
    "max_n": 8,
    "ladder": ((2, 4), (4, 8), (8, 16)),
    "max_block": 16,
    "max_edits": 1,
    "realign": True,
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_ladder(value: Any) -> tuple[tuple[int, int], ...]:
    """Validate a ladder: ``[[match_len, block], ...]`` with increasing ``match_len``."""
    try:
        rungs = [tuple(r) for r in value]
    except TypeError:
        rungs = None
    if not rungs or any(len(r) != 2 or not all(_is_int(x) for x in r) for r in rungs):
        raise specdec.PolicyError(
            f"{NAME}: option ladder must be a non-empty list of [match_len, block] "
            f"integer pairs, e.g. [[2, 4], [4, 8], [8, 16]]; got {value!r}"
        )
    prev = 0
    for match_len, block in rungs:
        if match_len <= prev:
            raise specdec.PolicyError(
                f"{NAME}: ladder match lengths must be >= 1 and strictly increasing; got {value!r}"
            )
        if block < 1:
            raise specdec.PolicyError(f"{NAME}: ladder block sizes must be >= 1; got {value!r}")
        prev = match_len
    return tuple((int(m), int(b)) for m, b in rungs)


class NgramCopyDrafter(BaseDrafter):
    """Prompt-lookup drafting from an incremental n-gram index.

    Args:
        source: ``"all"`` copies from the prompt and the generated output;
            ``"prompt"`` copies from the prompt only.
        min_n: the shortest n-gram that counts as a match.
        max_n: the longest n-gram looked up (longer matches are still measured by
            extending backwards, up to 64 tokens).
        ladder: ``[[match_len, block], ...]``: a match at least ``match_len`` tokens
            long proposes up to ``block`` tokens (the last rung that fits wins); a
            match shorter than the first rung proposes nothing.
        max_block: the largest block this drafter proposes. The core's
            ``max_len`` (policy ``max_block``, tokens left, the governor's budget)
            may cut it shorter.
        max_edits: edited tokens (substituted, inserted, deleted) a match may step
            over when it is extended backwards, 0 to 2 (0: exact matching).
        realign: right after an edit, copy on from the aligned source position
            past the edited token.

    Raises:
        specdec.PolicyError: an option has a bad value.
    """

    name = NAME

    def __init__(
        self,
        *,
        source: str = DEFAULTS["source"],
        min_n: int = DEFAULTS["min_n"],
        max_n: int = DEFAULTS["max_n"],
        ladder: Sequence[Sequence[int]] = DEFAULTS["ladder"],
        max_block: int = DEFAULTS["max_block"],
        max_edits: int = DEFAULTS["max_edits"],
        realign: bool = DEFAULTS["realign"],
    ) -> None:
        if source not in SOURCES:
            raise specdec.PolicyError(
                f"{NAME}: option source must be one of {list(SOURCES)}, got {source!r}"
            )
        for label, value in (("min_n", min_n), ("max_n", max_n), ("max_block", max_block)):
            if not _is_int(value) or value < 1:
                raise specdec.PolicyError(
                    f"{NAME}: option {label} must be an integer >= 1, got {value!r}"
                )
        if min_n > max_n:
            raise specdec.PolicyError(f"{NAME}: min_n ({min_n}) must be <= max_n ({max_n})")
        if not _is_int(max_edits) or not 0 <= max_edits <= 2:
            raise specdec.PolicyError(
                f"{NAME}: option max_edits must be 0, 1 or 2, got {max_edits!r}"
            )
        if not isinstance(realign, bool):
            raise specdec.PolicyError(
                f"{NAME}: option realign must be true or false, got {realign!r}"
            )
        self.source = source
        self.min_n = min_n
        self.max_n = max_n
        self.ladder = _parse_ladder(ladder)
        self.max_block = max_block
        self.max_edits = max_edits
        self.realign = realign

    # -- the Drafter protocol -------------------------------------------------------

    def session(self, ctx: RequestContext) -> NgramCopySession:
        """A request's session: the prompt indexed (O(1) per token)."""
        return NgramCopySession(self, ctx.prompt_tokens)

    def block_for(self, match_len: int) -> int:
        """The ladder's block size for a match of ``match_len`` tokens (0 below the first rung)."""
        block = 0
        for rung_len, rung_block in self.ladder:
            if match_len < rung_len:
                break
            block = rung_block
        return block


class NgramCopySession(BaseDrafterSession):
    """One request of ``ngram_copy``: its n-gram index and counts.

    Args:
        drafter: the drafter whose options apply.
        prompt_tokens: the request's prompt, indexed at once.
    """

    def __init__(self, drafter: NgramCopyDrafter, prompt_tokens: Sequence[int]) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self._prompt_len = 0
        self._dirty = False
        self._reset_stats()
        self._rebuild([int(t) for t in prompt_tokens], prompt_len=len(prompt_tokens))

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Copy what followed the best earlier occurrence of the end of ``history``.

        Args:
            history: every committed token (prompt + output). Normally the index
                already holds it; new tokens are appended, and a history that
                disagrees with the index is re-indexed (counted in ``resyncs``).
            max_len: the most tokens the core accepts this round.

        Returns:
            A deterministic :class:`specdec.Draft`, or ``None`` when nothing matches
            (or the match is shorter than the ladder's first rung, or ``max_len < 1``).
        """
        self._sync(history)
        if max_len < 1:
            return None
        self.lookups += 1
        match = self.index.find()
        if match is None:
            self.misses += 1
            return None
        size = min(self.drafter.block_for(match.length), self.drafter.max_block, max_len)
        tokens = self.index.continuation(match, size) if size > 0 else []
        if not tokens:
            self.misses += 1
            return None
        self.hits += 1
        if match.skipped:
            self.realigned += 1
        self.proposed_tokens += len(tokens)
        self.match_len_total += match.length
        self.longest_match = max(self.longest_match, match.length)
        self.last_match = match
        return Draft(tokens=tokens)

    def observe(self, result: RoundResult) -> None:
        """Index the tokens committed this round (whoever drafted them)."""
        if result.drafter == self.name:
            self.accepted_tokens += result.n_accepted
            self.rounds_verified += 1
        committed = result.committed
        if not committed:
            return
        have = len(self.index)
        start = result.start_position
        if start <= 0 and have > 0:
            # The position is unknown: assume the round follows what is indexed.
            self.index.extend(committed)
            return
        if start > have:
            return  # a gap: propose() catches up from the history
        overlap = min(have - start, len(committed))
        if overlap and list(committed[:overlap]) != self.index.tokens[start : start + overlap]:
            self._dirty = True  # disagrees with what was indexed: re-index at propose()
            return
        self.index.extend(committed[overlap:])

    def end(self) -> None:
        """Drop the per-request index."""
        self._prompt_len = 0
        self.index = self._new_index(0)

    def stats(self) -> dict:
        """Per-request counts: lookups, hits (``realigned``: after an edit), misses,
        proposed/accepted tokens, match lengths, index size, resyncs."""
        return {
            "source": self.drafter.source,
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.misses,
            "proposed_tokens": self.proposed_tokens,
            "accepted_tokens": self.accepted_tokens,
            "rounds_verified": self.rounds_verified,
            "mean_match_len": (self.match_len_total / self.hits) if self.hits else 0.0,
            "longest_match": self.longest_match,
            "realigned": self.realigned,
            "indexed_tokens": len(self.index),
            "index_entries": self.index.entries,
            "resyncs": self.resyncs,
        }

    # -- helpers ------------------------------------------------------------------

    def _new_index(self, prompt_len: int) -> NgramIndex:
        # "prompt": copy only from the first prompt_len tokens.
        d = self.drafter
        limit = prompt_len if d.source == "prompt" else None
        return NgramIndex(d.min_n, d.max_n, limit=limit, max_edits=d.max_edits, realign=d.realign)

    def _rebuild(self, tokens: list[int], *, prompt_len: int | None = None) -> None:
        if prompt_len is not None:
            self._prompt_len = prompt_len
        self.index = self._new_index(self._prompt_len)
        self.index.extend(tokens)
        self._dirty = False

    def _sync(self, history: Sequence[int]) -> None:
        # Cheap checks only (length and boundary token): a full comparison would
        # rescan the context every round.
        have = len(self.index)
        n = len(history)
        toks = self.index.tokens
        if not self._dirty:
            if n == have and (n == 0 or int(history[-1]) == toks[-1]):
                return
            if n > have and (have == 0 or int(history[have - 1]) == toks[-1]):
                self.index.extend(int(t) for t in history[have:])
                return
        self.resyncs += 1
        self._rebuild([int(t) for t in history])

    def _reset_stats(self) -> None:
        self.lookups = 0
        self.hits = 0
        self.misses = 0
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.rounds_verified = 0
        self.match_len_total = 0
        self.longest_match = 0
        self.realigned = 0
        self.last_match: NgramMatch | None = None
        self.resyncs = 0


def create_ngram_copy(**options: Any) -> NgramCopyDrafter:
    """Factory registered as ``ngram_copy``: builds the drafter from policy options.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise specdec.PolicyError(
            f"{NAME}: unknown option(s) {unknown}; accepted options are {sorted(DEFAULTS)}"
        )
    return NgramCopyDrafter(**options)
