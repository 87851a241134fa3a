"""Shadow scoring: what a proposal that was not verified would have scored.

When a governor suspends a drafter, or a drafter decides a block does not pay,
nothing is verified, so nothing is learnt, and a suspension can only end by
waiting. A proposal is deterministic, though, and the target commits its own
tokens anyway: comparing the proposal with the tokens committed from its start
position on gives exactly the number of its tokens a verify would have
accepted under greedy decoding (and a sample of it under sampling), at no
extra forward. :class:`ShadowScore` keeps one such proposal and is fed the
rounds that follow until a token differs or every token was matched.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ShadowScore"]


class ShadowScore:
    """One unverified proposal, scored against the tokens committed after it.

    Args:
        start_position: the absolute position of the proposal's first token.
        tokens: the proposed tokens.

    Attributes:
        matched: how many leading tokens matched so far.
        resolved: a token differed, or every token matched.
        lost: the rounds skipped past the proposal's next position (nothing more
            can be learnt; ``resolved`` is set and the outcome is not to be used).
    """

    __slots__ = ("start_position", "tokens", "matched", "resolved", "lost")

    def __init__(self, start_position: int, tokens: Sequence[int]) -> None:
        self.start_position = int(start_position)
        self.tokens = tuple(int(t) for t in tokens)
        self.matched = 0
        self.resolved = not self.tokens
        self.lost = False

    @property
    def proposed(self) -> int:
        """The proposal's length."""
        return len(self.tokens)

    @property
    def full(self) -> bool:
        """Every token matched."""
        return self.resolved and not self.lost and self.matched == len(self.tokens)

    def feed(self, start_position: int, committed: Sequence[int]) -> bool:
        """Compare the tokens committed at ``start_position`` with the proposal.

        Returns:
            Whether the proposal is resolved now.
        """
        if self.resolved:
            return True
        nxt = self.start_position + self.matched
        offset = nxt - int(start_position)
        if offset < 0:  # a gap: the tokens at nxt were never seen
            self.resolved = self.lost = True
            return True
        for tok in committed[offset:]:
            if int(tok) != self.tokens[self.matched]:
                self.resolved = True
                return True
            self.matched += 1
            if self.matched == len(self.tokens):
                self.resolved = True
                return True
        return False

    def outcome(self) -> tuple[int, int]:
        """``(proposed, accepted)`` as a verify of the proposal would have reported it."""
        return len(self.tokens), self.matched

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("resolved" if self.resolved else "pending")
        return (
            f"ShadowScore(start={self.start_position}, matched={self.matched}/"
            f"{len(self.tokens)}, {state})"
        )
