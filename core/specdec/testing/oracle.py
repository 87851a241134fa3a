"""The oracle drafter: proposes the target's own greedy continuation, optionally corrupted."""

from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from typing import Any

import mlx.core as mx

from ..hookspecs import hookimpl
from ..roles import BaseDrafter, BaseDrafterSession, Draft, RequestContext

CORRUPTIONS = ("none", "partial", "full")


class OracleDrafter(BaseDrafter):
    """Proposes what the target would emit greedily, with controllable corruption.

    Args:
        model: the target model; the continuation is computed by running it
            greedily from scratch on the history (tiny models only).
        reference: alternatively, the full expected token stream (prompt +
            plain greedy output); proposals follow it while the history is a
            prefix of it, and stop otherwise.
        corruption: ``"none"`` (full acceptance under greedy), ``"partial"``
            (the token in the middle of each block is wrong), ``"full"`` (every
            token wrong: zero acceptance), or a float in [0, 1]: the chance each
            token is wrong (seeded by ``seed``).
        block: tokens proposed per round (capped by the round's budget).
        vocab_size: for corruption (default: the model's).
        at: propose only when the history has one of these lengths (``None``: in every
            round), e.g. to make drafting pause and resume.
    """

    name = "oracle"
    #: Sessions read only the history (and the model, from scratch): rows of a batch
    #: are independent.
    supports_batch = True

    def __init__(
        self,
        model: Any = None,
        reference: Sequence[int] | None = None,
        corruption: str | float = "none",
        block: int = 4,
        vocab_size: int | None = None,
        seed: int = 0,
        name: str = "oracle",
        at: Collection[int] | None = None,
    ):
        if model is None and reference is None:
            raise ValueError("OracleDrafter needs 'model' or 'reference'")
        if isinstance(corruption, str) and corruption not in CORRUPTIONS:
            raise ValueError(
                f"corruption must be one of {CORRUPTIONS} or a float, got {corruption!r}"
            )
        self.model = model
        self.reference = None if reference is None else [int(t) for t in reference]
        self.corruption = corruption
        self.block = int(block)
        self.name = name
        if vocab_size is None and model is not None:
            vocab_size = model.args.vocab_size
        self.vocab_size = vocab_size or (max(self.reference or [0]) + 2)
        self.seed = seed
        self.at = None if at is None else frozenset(int(n) for n in at)

    def continuation(self, history: Sequence[int], n: int) -> list[int]:
        """The target's greedy continuation of ``history`` (``n`` tokens), or the reference's."""
        if self.reference is not None:
            h = list(history)
            if self.reference[: len(h)] != h:
                return []
            return self.reference[len(h) : len(h) + n]
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        y = mx.array(list(history))
        out: list[int] = []
        for _ in range(n):
            logits = self.model(y[None], cache=cache)[0, -1]
            tok = int(mx.argmax(logits).item())
            out.append(tok)
            y = mx.array([tok])
        return out

    def session(self, ctx: RequestContext) -> OracleSession:
        """A session with its own corruption generator and counts. The generator is
        seeded by ``seed`` and the prompt's length, so that requests with prompts of
        different lengths (the rows of a batch) draw different corruptions, as
        independent requests would, and the same request draws the same ones."""
        n = len(ctx.prompt_tokens) if ctx is not None else 0
        return OracleSession(self, self.seed * 1_000_003 + n)


class OracleSession(BaseDrafterSession):
    """One request of the oracle: proposals made and the corruption generator."""

    def __init__(self, drafter: OracleDrafter, seed: int | None = None):
        self.drafter = drafter
        self._rng = random.Random(drafter.seed if seed is None else seed)
        self.proposals = 0

    def _corrupt(self, toks: list[int]) -> list[int]:
        vocab = self.drafter.vocab_size
        bad = lambda t: (t + 1) % vocab  # noqa: E731
        c = self.drafter.corruption
        if c == "none" or not toks:
            return toks
        if c == "full":
            return [bad(t) for t in toks]
        if c == "partial":
            i = len(toks) // 2
            return [bad(t) if j == i else t for j, t in enumerate(toks)]
        rate = float(c)
        return [bad(t) if self._rng.random() < rate else t for t in toks]

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """The (corrupted) greedy continuation of ``history``, at most ``min(block, max_len)`` tokens."""
        n = min(self.drafter.block, max_len)
        if n < 1 or (self.drafter.at is not None and len(history) not in self.drafter.at):
            return None
        toks = self._corrupt(self.drafter.continuation(history, n))
        if not toks:
            return None
        self.proposals += 1
        return Draft(tokens=toks)

    def stats(self) -> dict:
        """Number of proposals made."""
        return {"proposals": self.proposals}


class OraclePlugin:
    """A plugin object registering :class:`OracleDrafter` as ``oracle``."""

    @hookimpl
    def specdec_register_drafters(self, register):
        """Register the oracle drafter."""
        register(
            "oracle", OracleDrafter, description="test kit: the target's own greedy continuation"
        )


oracle_plugin = OraclePlugin()
