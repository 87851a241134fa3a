"""The ``draft_model`` drafter: a smaller mlx-lm model with the target's tokenizer.

Under greedy decoding it drafts argmax tokens (accepted by exact prefix);
under sampling it draws each draft token from its own distribution ``q``
(with the request's sampler filters) and hands ``q`` to rejection acceptance.
Drafting is lazy, as in mlx-lm's ``speculative_generate_step``: the draft
tokens stay on the device and the core queues the verify forward on them, so
a round syncs with the device once. Each request's session keeps its own
draft cache and rolls it back to the accepted prefix after every round.

In a :class:`specdec.Batch` the rows' draft caches are one batch cache
(:class:`DraftModelBatch`): each draft step is one forward for every row that
drafts, and each row keeps its own accepted prefix (the ``batch_kv`` rollback).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from ..capture import model_taps
from ..drafting import BatchRows, draft_lazily, draw
from ..errors import ModelLoadError, PolicyError
from ..heads import model_vocab_size
from ..options import Option, Options, non_empty
from ..roles import (
    Ask,
    BaseDrafter,
    BaseDrafterSession,
    BatchContext,
    Draft,
    PrefillChunk,
    RequestContext,
    RoundResult,
    optional,
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
    #: Rows of a batch draft together (:meth:`batch`).
    supports_batch = True

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

    def batch(self, ctx: BatchContext) -> DraftModelBatch:
        """The draft caches of a batch's rows as one batch cache.

        Raises:
            PolicyError: the draft model's caches cannot be rolled back per row after
                its one-token draft steps (sliding-window layers).
        """
        return DraftModelBatch(self, ctx)


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
        self.prompt = list(ctx.prompt_tokens)
        self.batched = False  # its cache became a row of a DraftModelBatch

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
        if self.batched:
            out["batched"] = True
        return out


class DraftModelBatch(BatchRows):
    """The draft caches of a :class:`specdec.Batch`'s rows as one mlx-lm batch cache.

    A round's asks are drafted together: the first step feeds every row what its draft
    cache has not seen (right-padded; rows that do not draft this round catch up too),
    then each further step is one ``[B, 1]`` forward. The first step's padding and,
    after the round, each row's rejected drafts are rolled back per row.
    """

    def __init__(self, drafter: DraftModelDrafter, ctx: BatchContext):
        super().__init__()
        self.drafter = drafter
        self.model = drafter.model
        self.k = drafter.num_draft_tokens
        probe = [type(c).merge([c]) for c in make_prompt_cache(self.model)]
        plan = build_plan(ctx.host, probe, model=self.model)
        unable = [
            f"{type(c).__name__} ({r.name if r is not None else 'no rollback'})"
            for c, r in zip(probe, plan.assigned)
            if r is None
            or not optional(r, "cache_rollback", "supports_batch")
            or type(c).__name__ != "BatchKVCache"
        ]
        if unable:
            raise PolicyError(
                f"drafter 'draft_model': the draft model's caches cannot be rolled back per "
                f"row after one-token draft steps: {unable[0]}; draft models with full "
                "attention only (KVCache layers) draft for rows of a batch"
            )
        self.host = ctx.host
        self.sessions: dict[int, DraftModelSession] = {}
        self.history: dict[int, list[int]] = {}  # each row's prompt + committed tokens
        self.plan: Any = None
        self.pending: tuple | None = None  # the open round's step transaction and blocks
        self.backbone: Any = None
        #: draft forwards run (each for every row), for tests and stats
        self.forwards = 0

    def join(self, row: int, session: DraftModelSession) -> None:
        """The row's draft cache (its prompt but the last token) becomes a row of the batch's."""
        if session.fed < len(session.prompt) - 1:  # not prefilled (a cached prompt prefix)
            rest = session.prompt[session.fed : -1]
            self.model(mx.array(rest)[None], cache=session.cache)
            session.fed += len(rest)
        self.add_row(row, session.cache)
        if self.plan is None:
            self.plan = build_plan(self.host, self.caches, model=self.model)
        session.cache = None
        session.batched = True
        self.sessions[row] = session
        self.history[row] = session.prompt[: session.fed + 1]

    def leave(self, rows: Sequence[int]) -> None:
        """Drop the rows' entries (mlx-lm's ``filter``)."""
        for r in self.drop_rows(rows):
            del self.sessions[r], self.history[r]
        self.pending = None
        if self.caches is None:
            self.plan = None

    def propose(self, asks: Sequence[Ask], caches: list) -> list[Draft | None]:
        """Draft every ask's block together, lazily (one forward per draft step); the
        target's ``caches`` are not read."""
        index = {r: i for i, r in enumerate(self.rows)}
        want: dict[int, tuple[Ask, int]] = {}
        for a in asks:
            n = min(a.max_len, self.k)
            if n >= 1:
                want[index[a.row]] = (a, n)
        if not want:
            return [None] * len(asks)
        feeds = []
        for i, r in enumerate(self.rows):
            fed = self.sessions[r].fed
            feed = list(want[i][0].history[fed:]) if i in want else self.history[r][fed:]
            if i in want and not feed:
                raise RuntimeError("draft_model: history is not ahead of the draft cache")
            feeds.append(feed)
        width = max(len(f) for f in feeds)
        steps = max(n for _, n in want.values())
        txn = self.plan.begin()
        step_txn = None
        try:
            tokens = mx.array([f + [0] * (width - len(f)) for f in feeds], dtype=mx.int32)
            last = mx.array([max(len(f), 1) - 1 for f in feeds])
            logits = self._logits(tokens, want, last)
            txn.commit(width, [len(f) for f in feeds])  # the padding out, every feed kept
            txn = None
            for i, r in enumerate(self.rows):
                self.sessions[r].fed += len(feeds[i])
            drawn: dict[int, list] = {i: [] for i in want}
            qs: dict[int, list] = {i: [] for i in want}
            pad = mx.zeros((1,), mx.int32)
            for step in range(steps):
                if step == 1:
                    step_txn = self.plan.begin()
                if step:
                    y = [drawn[i][-1] if i in drawn else pad for i in range(len(self.rows))]
                    logits = self._logits(mx.concatenate(y)[:, None], want, None)
                for i, (a, n) in want.items():
                    if step >= n:
                        continue
                    sampler = a.session.sampler
                    y_i, q = draw(
                        logits[i : i + 1], sampler, len(a.history) + step, greedy=sampler.is_greedy
                    )
                    if q is not None:
                        qs[i].append(q)
                    drawn[i].append(y_i.astype(mx.int32))
                mx.async_eval([d[-1] for d in drawn.values()])
        except BaseException:
            for t in (step_txn, txn):
                if t is not None:
                    t.abort()
            raise
        self.forwards += steps
        out: list[Draft | None] = []
        blocks = {}
        for a in asks:
            i = index[a.row]
            if i not in want:
                out.append(None)
                continue
            blocks[a.row] = toks = mx.concatenate(drawn[i])
            self.sessions[a.row].rounds += 1
            out.append(Draft(tokens=toks, probs=mx.stack(qs[i]) if qs[i] else None))
        self.pending = (step_txn, steps - 1, blocks)
        return out

    def _logits(self, tokens: mx.array, want: dict, last: mx.array | None) -> mx.array:
        """The draft model's next-token logits ``[B, vocab]`` after ``tokens`` ``[B, n]``
        (at each row's ``last`` position; the last one when ``None``), through the asking
        rows' head when the drafter has one."""
        if self.drafter.head is None:
            out = self.model(tokens, cache=self.caches).astype(mx.float32)
        else:
            if self.backbone is None:
                self.backbone = model_taps(self.model).backbone
            out = self.backbone(tokens, cache=self.caches)
        if last is None:
            out = out[:, -1]
        else:
            out = mx.take_along_axis(out, last[:, None, None], axis=1)[:, 0]
        if self.drafter.head is None:
            return out
        rows = [
            want[i][0].session.head.logits(out[i : i + 1], context=want[i][0].history)
            if i in want
            else None
            for i in range(tokens.shape[0])
        ]
        some = next(r for r in rows if r is not None)
        return mx.concatenate([some * 0 if r is None else r for r in rows])

    def observe(self, results: dict[int, RoundResult]) -> None:
        """Every row's committed tokens noted; each drafting row keeps its draft entries
        that match what it committed."""
        for r, res in results.items():
            self.history[r].extend(res.committed)
        if self.pending is None:
            return
        txn, n_fed, blocks = self.pending
        self.pending = None
        keeps = []
        for r in self.rows:
            res = results.get(r)
            m = 0
            if res is not None and r in blocks:
                fed_draft = res.proposals.get(self.drafter.name)
                if fed_draft is None:
                    fed_draft = tuple(blocks[r].tolist())
                for a, b in zip(fed_draft[:n_fed], res.committed):
                    if a != b:
                        break
                    m += 1
            keeps.append(m)
            self.sessions[r].fed += m
        if txn is not None:
            txn.commit(n_fed, keeps)

    def end(self) -> None:
        """Drop the draft caches."""
        self.caches = self.plan = self.pending = None
        self.rows, self.sessions, self.history = [], {}, {}
