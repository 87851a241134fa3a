"""specdec-example-drafter: a complete third-party drafter plugin for specdec.

The drafter ``example_repeat`` bets that text repeats itself: after token ``t``
it proposes the token that followed the previous occurrence of ``t``, then the
token that followed *that* token's previous occurrence, and so on, up to
``max_len`` tokens. It needs no model of its own and its drafts are
deterministic, so greedy output stays token-identical to plain decoding and
sampled output keeps the target's distribution (point-mass acceptance).

Enable it with ``specdec.Policy(drafters=("example_repeat",))`` once the
distribution is installed; its entry point in ``pyproject.toml`` is what makes
specdec find it.
"""

from __future__ import annotations

from collections.abc import Sequence

import specdec
from specdec import BaseDrafter, Draft, RequestContext

__version__ = "0.2.0"


class RepeatDrafter(BaseDrafter):
    """Proposes what followed the last token's previous occurrence, chained.

    Args:
        max_len: the longest block this drafter proposes. The policy's
            ``max_block`` and a governor may cut a block shorter still.

    Raises:
        specdec.PolicyError: ``max_len`` is not an integer >= 1.
    """

    name = "example_repeat"

    def __init__(self, *, max_len: int = 8) -> None:
        if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
            raise specdec.PolicyError(
                f"example_repeat: option max_len must be an integer >= 1, got {max_len!r}"
            )
        self.max_len = max_len
        self.proposals = 0
        self._reset()

    def begin(self, ctx: RequestContext) -> None:
        """Start a request: forget everything learned from the previous one."""
        self._reset()
        self.proposals = 0

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Follow the chain of "what came next last time" from ``history[-1]``.

        Returns:
            A deterministic :class:`specdec.Draft` (no draft probabilities), or
            ``None`` when the last token has not occurred before.
        """
        self._index(history)
        limit = min(max_len, self.max_len)
        block: list[int] = []
        token = self._next.get(history[-1]) if history else None
        while token is not None and len(block) < limit:
            block.append(token)
            token = self._next.get(token)
        if not block:
            return None
        self.proposals += 1
        return Draft(tokens=block)

    def end(self) -> None:
        """Finish a request: drop the per-request index."""
        self._reset()

    def stats(self) -> dict:
        """How many blocks this drafter proposed in the request."""
        return {"proposals": self.proposals}

    def _reset(self) -> None:
        self._next: dict[int, int] = {}
        self._indexed = 0

    def _index(self, history: Sequence[int]) -> None:
        # Within a request the history only grows, so index just the new pairs.
        if len(history) < self._indexed:
            self._reset()
        for i in range(max(self._indexed - 1, 0), len(history) - 1):
            self._next[history[i]] = history[i + 1]
        self._indexed = len(history)


@specdec.hookimpl
def specdec_register_drafters(register):
    """Register the ``example_repeat`` drafter with specdec."""
    register(
        "example_repeat",
        RepeatDrafter,
        description="Proposes what followed the last token's previous occurrence (example plugin).",
    )
