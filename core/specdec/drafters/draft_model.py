"""The ``draft_model`` drafter: a smaller mlx-lm model with the target's tokenizer.

Under greedy decoding it drafts argmax tokens (accepted by exact prefix);
under sampling it draws each draft token from its own distribution ``q``
(with the request's sampler filters) and hands ``q`` to rejection acceptance.
Its own cache is rolled back to the accepted prefix after every round.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..errors import ModelLoadError, PolicyError
from ..roles import BaseDrafter, Draft, RequestContext, RoundResult
from ..sampling import STREAM_DRAFT

_LOADED: dict[str, tuple[Any, Any]] = {}


def _vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    v = getattr(args, "vocab_size", None)
    if v is None and hasattr(model, "model") and hasattr(model.model, "embed_tokens"):
        v = model.model.embed_tokens.weight.shape[0]
    return v


def _load(path: str) -> tuple[Any, Any]:
    if path not in _LOADED:
        from ..loading import load_model

        _LOADED[path] = load_model(path, what="draft model")
    return _LOADED[path]


class DraftModelDrafter(BaseDrafter):
    """Drafts ``num_draft_tokens`` tokens autoregressively with a small model.

    Args:
        model: an mlx-lm model object, or a path / Hub id to load.
        num_draft_tokens: tokens drafted per round (capped by the round's budget).
    """

    name = "draft_model"

    def __init__(self, model: Any = None, num_draft_tokens: int = 4):
        if model is None:
            raise PolicyError(
                "drafter 'draft_model' needs option 'model' (a path, Hub id or mlx-lm model); "
                "use --draft-model PATH or Policy.with_options('draft_model', model=...)"
            )
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise PolicyError(
                f"draft_model option num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}"
            )
        if isinstance(model, (str, os.PathLike)):
            self.model, self.tokenizer = _load(os.fspath(model))
        else:
            self.model, self.tokenizer = model, None
        self.num_draft_tokens = num_draft_tokens
        self._cache: list | None = None

    def attach(self, target: Any, tokenizer: Any) -> None:
        """Refuse a draft model whose vocabulary differs from the target's."""
        tv, dv = _vocab_size(target), _vocab_size(self.model)
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

    def begin(self, ctx: RequestContext) -> None:
        """Fresh draft cache and a rollback plan from every registered rollback (plugins too)."""
        from ..plugins import get_plugin_host
        from ..rollback import build_plan

        self._sampler = ctx.sampler
        self._cache = make_prompt_cache(self.model)
        self._plan = build_plan(ctx.host or get_plugin_host(), self._cache, model=self.model)
        if not self._plan.ok:
            raise ModelLoadError(f"draft model cache cannot be rolled back: {self._plan.reason}")
        self._fed = 0  # history tokens whose K/V are in the draft cache
        self._pending: tuple | None = None
        self.rounds = 0

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Feed the unseen history, then draft up to ``min(max_len, num_draft_tokens)`` tokens."""
        n = min(max_len, self.num_draft_tokens)
        if n < 1:
            return None
        pending = list(history[self._fed :])
        if not pending:  # the last token must be fed to get a next-token distribution
            raise RuntimeError("draft_model: history is not ahead of the draft cache")
        if len(pending) > 1:  # committed tokens: outside the transaction
            self.model(mx.array(pending[:-1])[None], cache=self._cache)
            self._fed += len(pending) - 1
            pending = pending[-1:]
        txn = self._plan.begin()
        try:
            y = mx.array(pending)
            tokens: list[int] = []
            qs = []
            pos = len(history)
            for i in range(n):
                logits = self.model(y[None], cache=self._cache)[0, -1:].astype(mx.float32)
                if self._sampler.is_greedy:
                    tok = int(mx.argmax(logits, axis=-1).item())
                else:
                    q = self._sampler.probs(logits)
                    tok = self._sampler.sample(logits, [pos + i], STREAM_DRAFT)[0]
                    qs.append(q[0])
                tokens.append(tok)
                if i + 1 < n:
                    y = mx.array([tok])
        except BaseException:
            txn.abort()
            raise
        n_fed = len(pending) + n - 1
        self._pending = (txn, n_fed, len(history), tuple(tokens[:-1]))
        self.rounds += 1
        return Draft(tokens=tokens, probs=mx.stack(qs) if qs else None)

    def observe(self, result: RoundResult) -> None:
        """Keep the draft cache's entries that match the committed tokens."""
        if self._pending is None:
            return
        txn, n_fed, hist_len, fed_draft = self._pending
        self._pending = None
        m = 0
        for a, b in zip(fed_draft, result.committed):
            if a != b:
                break
            m += 1
        n_keep = (hist_len - self._fed) + m
        txn.commit(n_fed, n_keep)
        self._fed = hist_len + m

    def end(self) -> None:
        """Drop the draft cache."""
        self._cache = None
        self._pending = None
