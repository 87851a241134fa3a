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

The drafter object is shared by every request of a pipeline and holds only
its options; what it learns about one request lives in the
:class:`RepeatSession` it makes for that request.
"""

from __future__ import annotations

from collections.abc import Sequence

import specdec
from specdec import BaseDrafter, BaseDrafterSession, Draft, RequestContext

__version__ = "0.3.0"


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

    def session(self, ctx: RequestContext) -> RepeatSession:
        """Start a request: a fresh session that knows nothing yet."""
        return RepeatSession(self.max_len)


class RepeatSession(BaseDrafterSession):
    """One request of ``example_repeat``: the "what came next" index and a count.

    Args:
        max_len: the drafter's ``max_len`` option.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.proposals = 0
        self._reset()

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
        """Finish the request: drop the index."""
        self._reset()

    def stats(self) -> dict:
        """How many blocks this session proposed."""
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
