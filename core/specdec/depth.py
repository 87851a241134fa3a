"""How many tokens a model-head drafter drafts next round (shared by the head drafters).

A drafter whose every draft costs a step of its own (an MTP head, an assistant model)
starts from a configured depth and adapts it to how far its drafts are accepted:
:class:`AdaptiveDepth` keeps the outcomes of the last rounds and grows or shrinks the
depth by one at a time. ``qwen_mtp`` (specdec-plugin-qwen-mtp-gdn) and ``gemma4_mtp``
(specdec-plugin-gemma4-mtp) use it.
"""

from __future__ import annotations

from collections import deque


class AdaptiveDepth:
    """How many tokens to draft next round, from the outcomes of the last ``window`` rounds.

    - **Grow** by one (up to ``max_depth``) once the window is full and at least
      ``grow_at`` of its rounds at the current depth had every draft accepted.
    - **Shrink** by one (down to ``min_depth``) once the deepest position no longer pays
      for its draft step and its verify width: among at least 8 rounds of the window
      that reached it (all shallower drafts accepted) it was accepted in fewer than
      ``shrink_below`` of them, or among at least 8 rounds that drafted it fewer than
      ``shrink_below`` reached it at all.

    The window is cleared after each change, so the new depth is judged on its own.
    Every outcome is also counted per position, for the drafter's stats
    (:meth:`stats`).

    Args:
        depth: the depth to start from.
        max_depth: the most it grows to (a ceiling).
        adaptive: ``False`` keeps ``depth`` whatever the outcomes.
        grow_at: the share of full-depth rounds that grows the depth.
        shrink_below: the acceptance of the deepest position below which it shrinks.
        window: how many recent rounds are looked at.
        min_depth: the least it shrinks to (``1``; a drafter whose configured depth is a
            floor, such as ``gemma4_mtp``, passes its configured depth).

    Raises:
        ValueError: ``min_depth <= depth <= max_depth`` does not hold, or ``min_depth < 1``.
    """

    def __init__(
        self,
        depth: int,
        max_depth: int,
        *,
        adaptive: bool = True,
        grow_at: float = 0.65,
        shrink_below: float = 0.3,
        window: int = 32,
        min_depth: int = 1,
    ) -> None:
        if not 1 <= min_depth <= depth <= max_depth:
            raise ValueError(
                f"AdaptiveDepth needs 1 <= min_depth <= depth <= max_depth, got "
                f"min_depth={min_depth}, depth={depth}, max_depth={max_depth}"
            )
        self.depth = depth
        self.min_depth = min_depth
        self.max_depth = max_depth
        self.adaptive = adaptive
        self.grow_at = grow_at
        self.shrink_below = shrink_below
        self.window = window
        self.recent: deque = deque(maxlen=window)
        self.grew = self.shrank = 0
        #: index i is draft position i + 1: the rounds that drafted it, and of those
        #: the rounds that accepted it (and so every draft before it).
        self.reached = [0] * max_depth
        self.accepted = [0] * max_depth

    def observe(self, proposed: int, accepted: int) -> int:
        """Learn a round's outcome (``accepted`` of ``proposed`` drafts); returns the
        depth for the next round."""
        for i in range(min(proposed, len(self.reached))):
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1
        self.recent.append((proposed, accepted))
        if not self.adaptive:
            return self.depth
        at_depth = [a >= k for k, a in self.recent if k == self.depth]
        if (
            len(self.recent) == self.window
            and self.depth < self.max_depth
            and len(at_depth) >= self.window // 2
            and sum(at_depth) / len(at_depth) >= self.grow_at
        ):
            self.depth += 1
            self.grew += 1
            self.recent.clear()
        elif self.depth > self.min_depth:
            deep = self.depth - 1  # drafts before the deepest position
            drafted = [a for k, a in self.recent if k > deep]
            reached = [a for a in drafted if a >= deep]
            rarely_reached = len(drafted) >= 8 and len(reached) / len(drafted) < self.shrink_below
            rarely_kept = (
                len(reached) >= 8
                and sum(a > deep for a in reached) / len(reached) < self.shrink_below
            )
            if rarely_reached or rarely_kept:
                self.depth -= 1
                self.shrank += 1
                self.recent.clear()
        return self.depth

    def stats(self) -> dict:
        """The depth now, how often it grew and shrank, and per-position acceptance:
        ``position_reached[i]`` rounds drafted position ``i + 1``, ``position_accepted[i]``
        of them accepted it, ``position_acceptance[i]`` is their ratio (positions never
        drafted are left out)."""
        n = sum(1 for r in self.reached if r)
        return {
            "depth": self.depth,
            "depth_grew": self.grew,
            "depth_shrank": self.shrank,
            "position_reached": self.reached[:n],
            "position_accepted": self.accepted[:n],
            "position_acceptance": [
                round(a / r, 4) for a, r in zip(self.accepted[:n], self.reached[:n])
            ],
        }
