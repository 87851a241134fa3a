"""The ``draft_model`` drafter: a smaller mlx-lm model with the target's tokenizer.

Under greedy decoding it drafts argmax tokens (accepted by exact prefix);
under sampling it draws each draft token from its own distribution ``q``
(with the request's sampler filters) and hands ``q`` to rejection acceptance.
Drafting is lazy, as in mlx-lm's ``speculative_generate_step``: the draft
tokens stay on the device and the core queues the verify forward on them, so
a round syncs with the device once. Each request's session keeps its own
draft cache and rolls it back to the accepted prefix after every round.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..capture import model_taps
from ..drafting import draft_lazily
from ..errors import ModelLoadError, PolicyError
from ..heads import model_vocab_size
from ..options import Option, Options, non_empty
from ..roles import (
    BaseDrafter,
    BaseDrafterSession,
    Draft,
    PrefillChunk,
    RequestContext,
    RoundResult,
)
from ..rollback import build_plan

#: The options of ``draft_model``.
OPTIONS = Options(
    "draft_model",
    [
        Option("model", accepted="a path, Hub id or mlx-lm model"),
        Option("num_draft_tokens", int, default=4, minimum=1),
        Option("head", str, check=non_empty, accepted="a draft head name"),
    ],
)


class DraftModelDrafter(BaseDrafter):
    """Drafts ``num_draft_tokens`` tokens autoregressively with a small model.

    A model given as a path is loaded here, once per pipeline, and freed with it.

    Args:
        model: an mlx-lm model object, or a path / Hub id to load.
        num_draft_tokens: tokens drafted per round (capped by the round's budget).
        head: a draft head name (``None``: the draft model's own output path). The head
            is bound to the draft model (its output layer, its tokenizer), e.g.
            ``coarse_head`` to score the draft model's vocabulary cheaply.
    """

    name = "draft_model"
    #: A replicated draft model drafts the same block and q on every rank of a sharded
    #: target: q need not be broadcast.
    deterministic = True

    def __init__(
        self,
        model: Any = None,
        num_draft_tokens: int = OPTIONS.defaults["num_draft_tokens"],
        head: str | None = None,
    ):
        o = OPTIONS.parse({"model": model, "num_draft_tokens": num_draft_tokens, "head": head})
        if o.model is None:
            raise PolicyError(
                "drafter 'draft_model' needs option 'model' (a path, Hub id or mlx-lm model); "
                "use --draft-model PATH or Policy.with_options('draft_model', model=...)"
            )
        if isinstance(o.model, (str, os.PathLike)):
            from ..loading import load_model

            self.model, self.tokenizer = load_model(os.fspath(o.model), what="draft model")
        else:
            self.model, self.tokenizer = o.model, None
        self.num_draft_tokens = o.num_draft_tokens
        self.head = o.head
        #: The head (if any) reads the draft model's output layer, not the target's.
        self.head_model = self.model if head is not None else None
        self.head_tokenizer = self.tokenizer

    def attach(self, target: Any, tokenizer: Any) -> None:
        """Refuse a draft model whose vocabulary differs from the target's."""
        tv, dv = model_vocab_size(target), model_vocab_size(self.model)
        if tv is not None and dv is not None and tv != dv:
            raise ModelLoadError(
                f"draft model vocabulary size {dv} differs from the target's {tv}: "
                "a draft model must share the target's tokenizer"
            )
        if tokenizer is not None and self.tokenizer is not None:
            try:
                same = tokenizer.vocab_size == self.tokenizer.vocab_size and (
                    tokenizer.get_vocab() == self.tokenizer.get_vocab()
                )
            except Exception:  # tokenizers without get_vocab: sizes were checked
                same = True
            if not same:
                raise ModelLoadError(
                    "draft model tokenizer differs from the target's: a draft model must share "
                    "the target's vocabulary"
                )

    def session(self, ctx: RequestContext) -> DraftModelSession:
        """A fresh draft cache for the request, rolled back with every registered rollback."""
        return DraftModelSession(self, ctx)


class DraftModelSession(BaseDrafterSession):
    """One request's draft cache and pending transaction."""

    def __init__(self, drafter: DraftModelDrafter, ctx: RequestContext):
        self.name = drafter.name
        self.model = drafter.model
        self.num_draft_tokens = drafter.num_draft_tokens
        self.sampler = ctx.sampler
        self.head = ctx.head
        self.backbone = model_taps(self.model).backbone if self.head is not None else None
        self.cache = make_prompt_cache(self.model)
        self.plan = build_plan(ctx.host, self.cache, model=self.model)
        if not self.plan.ok:
            raise ModelLoadError(f"draft model cache cannot be rolled back: {self.plan.reason}")
        self.fed = 0  # history tokens whose K/V are in the draft cache
        self.pending: tuple | None = None
        self.rounds = 0

    def prefill(self, chunk: PrefillChunk) -> None:
        """Prefill the draft cache with the prompt, chunk by chunk, as the target is prefilled."""
        if chunk.start_position != self.fed:
            return  # not contiguous: propose() feeds what is missing
        self.model(mx.array(chunk.tokens)[None], cache=self.cache)
        mx.eval([c.state for c in self.cache])
        self.fed += len(chunk.tokens)

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Feed the unseen history, then draft up to ``min(max_len, num_draft_tokens)`` tokens (lazily)."""
        n = min(max_len, self.num_draft_tokens)
        if n < 1:
            return None
        pending = list(history[self.fed :])
        if not pending:  # the last token must be fed to get a next-token distribution
            raise RuntimeError("draft_model: history is not ahead of the draft cache")
        if len(pending) > 2:  # a long unseen stretch: outside the transaction
            self.model(mx.array(pending[:-1])[None], cache=self.cache)
            self.fed += len(pending) - 1
            pending = pending[-1:]
        # The one or two committed tokens the draft cache has not seen (after a fully
        # accepted block: the last draft and the bonus token) go in with the first draft
        # step, one forward, as in mlx-lm; commit() keeps them whatever is rejected.
        txn = self.plan.begin()
        first = mx.array(pending)

        def step(i: int, previous: Any) -> mx.array:
            y = first if previous is None else previous
            if self.head is None:
                return self.model(y[None], cache=self.cache)[0, -1:].astype(mx.float32)
            # the backbone's last state through the named head
            h = self.backbone(y[None], cache=self.cache)[0, -1:]
            return self.head.logits(h, context=history)

        try:
            draft = draft_lazily(n, step, self.sampler, len(history), greedy=self.sampler.is_greedy)
        except BaseException:
            txn.abort()
            raise
        self.pending = (txn, len(pending) + n - 1, len(history), draft.tokens)
        self.rounds += 1
        return draft

    def observe(self, result: RoundResult) -> None:
        """Keep the draft cache's entries that match the committed tokens."""
        if self.pending is None:
            return
        txn, n_fed, hist_len, block = self.pending
        self.pending = None
        fed_draft = result.proposals.get(self.name)
        if fed_draft is None:
            fed_draft = tuple(block.tolist())
        m = 0
        for a, b in zip(fed_draft[:-1], result.committed):
            if a != b:
                break
            m += 1
        txn.commit(n_fed, (hist_len - self.fed) + m)
        self.fed = hist_len + m

    def end(self) -> None:
        """Drop the draft cache."""
        self.cache = None
        self.pending = None

    def stats(self) -> dict:
        """Rounds drafted and the tokens drafted per round."""
        out = {"draft_rounds": self.rounds, "num_draft_tokens": self.num_draft_tokens}
        if self.head is not None:
            out["head"] = self.head.name
        return out
