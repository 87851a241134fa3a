"""The ``qwen_mtp`` drafter: the target's own MTP head drafts for it.

A round's drafting, for a history of ``n`` tokens (the last one, at ``n - 1``, not yet
through the target):

1. **Catch-up.** The head's cache holds one entry per position ``t`` whose true
   target hidden state ``h_t`` is known and whose next token ``x[t+1]`` is committed.
   The pairs the last rounds made known (``h_t`` from the verify forwards' rows of the
   accepted tokens, ``x[t+1]`` from the history) go through the head in one call, up
   to position ``n - 2``. Its last output predicts ``x[n]``: the first draft. The first
   round's pairs come from prefill (every prompt chunk's hidden states), so the first
   round drafts too.
2. **Recursion.** Each further draft feeds the head's own output (after its final
   norm) as the hidden state and the previous draft as the token, one position on.
3. **Rollback.** The recursive entries of the head's cache are dropped at once (they
   were built from the head's guesses); the next catch-up writes the true ones.

No second target forward is ever needed. Greedy drafts are the head's argmax; under
sampling they are drawn from the head's distribution with the request's sampler
(``specdec.sampling.STREAM_DRAFT`` keys), which is returned as ``q`` for rejection sampling.

In a :class:`specdec.Batch` the rows' head caches are one batch cache
(:class:`QwenMTPBatch`): every row's catch-up is one right-padded head call, each
recursion step one call for every drafting row, the recursive entries dropped by one
uniform trim. The rows' bookkeeping (pending hidden rows, depth) stays in their sessions.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import specdec
from specdec import (
    BaseDrafter,
    BaseDrafterSession,
    Draft,
    PrefillChunk,
    RequestContext,
    RoundResult,
)
from specdec.depth import AdaptiveDepth
from specdec.drafting import BatchRows, draw
from specdec.options import Option, Options, non_empty
from specdec.roles import Ask, BatchContext
from specdec.rollback import BatchKVRollback

from .mtp import MTPLoadError, load_mtp, text_model

NAME = "qwen_mtp"

#: The options of ``qwen_mtp`` (see the README).
OPTIONS = Options(
    NAME,
    [
        Option("mtp_path", (str, os.PathLike), accepted="a folder or file path"),
        Option("depth", int, default=3, minimum=1),
        Option("max_depth", int, default=6, minimum=1),
        Option("adaptive", bool, default=True),
        Option("grow_at", float, default=0.65, minimum=0, maximum=1),
        Option("shrink_below", float, default=0.3, minimum=0, maximum=1),
        Option("window", int, default=32, minimum=2),
        Option("head", str, default="exact", check=non_empty, accepted="a draft head name"),
        Option(
            "norm_shift",
            default=True,
            choices=("auto", True, False),
            accepted="'auto', true or false",
        ),
        Option(
            "sampled_drafts",
            str,
            default="sample",
            choices=("sample", "greedy"),
            accepted="'sample' or 'greedy'",
        ),
    ],
)
#: Default options of ``qwen_mtp``.
DEFAULTS: Mapping[str, Any] = OPTIONS.defaults

#: Pending target hidden rows fed eagerly once this many accumulate (rounds other
#: drafters won), so memory stays bounded.
_MAX_PENDING = 256


class QwenMTPDrafter(BaseDrafter):
    """Drafts with the native MTP head of a Qwen3-Next / Qwen3.5 target.

    Args:
        mtp_path: the original Hugging Face checkpoint folder (or a ``.safetensors``
            file) holding the ``mtp.*`` weights; ``None``: the target's own model folder
            (:func:`specdec.loading.model_source`).
        depth: drafts per round to start with.
        max_depth: the most drafts per round adaptive depth grows to.
        adaptive: grow and shrink the depth from the acceptance of the last rounds.
        grow_at: grow by one once this fraction of the last ``window`` rounds had every
            draft accepted.
        shrink_below: shrink by one once the deepest position's acceptance, given the
            one before it was accepted, falls below this over the last rounds.
        window: the rounds adaptive depth looks at.
        head: the draft head turning the MTP output into logits (``"exact"``: the
            target's own output layer; ``"coarse_head"`` once installed).
        norm_shift: ``True`` (the Hugging Face convention: norm weights stored as
            ``w - 1``), ``False``, or ``"auto"`` (per weight, for re-exports that mix
            conventions; see :func:`specdec_qwen_mtp_gdn.mtp.shift_norms`).
        sampled_drafts: under temperature > 0, ``"sample"`` draws each draft from the
            head's distribution and hands it over as ``q``; ``"greedy"`` drafts the
            head's argmax (point masses, no ``q``), so a seeded run emits exactly the
            tokens of the seeded plain run.

    Raises:
        specdec.PolicyError: an option has a bad value.
    """

    name = NAME
    needs = frozenset({"hidden"})
    supports_batch = True

    def __init__(self, **options: Any) -> None:
        o = OPTIONS.parse(options)
        if o.max_depth < o.depth:
            raise specdec.PolicyError(
                f"{NAME}: max_depth ({o.max_depth}) must be >= depth ({o.depth})"
            )
        self.mtp_path = None if o.mtp_path is None else Path(os.fspath(o.mtp_path)).expanduser()
        self.depth = o.depth
        self.max_depth = o.max_depth
        self.adaptive = o.adaptive
        self.grow_at = o.grow_at
        self.shrink_below = o.shrink_below
        self.window = o.window
        self.head = o.head
        self.norm_shift = o.norm_shift
        self.sampled_drafts = o.sampled_drafts
        self.module: Any = None
        self.info: dict = {}
        self._target = None

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Load the MTP head for ``model`` (once per pipeline), before any request.

        Raises:
            MTPLoadError (a :class:`specdec.ModelLoadError`): no MTP weights where they
                were looked for, or weights that do not fit ``model``.
        """
        if self._target is model and self.module is not None:
            return
        source = self.mtp_path or specdec.loading.model_source(model)
        if source is None:
            raise MTPLoadError(
                f"{NAME}: the target model was not loaded from a local folder, so there is no "
                "checkpoint to read its MTP head from; set the qwen_mtp option mtp_path to the "
                "original Hugging Face checkpoint folder"
            )
        self.module, self.info = load_mtp(model, source, norm_shift=self.norm_shift)
        self._target = model

    def session(self, ctx: RequestContext) -> QwenMTPSession:
        """A fresh head cache for the request."""
        if self.module is None or self._target is not ctx.model:
            self.attach(ctx.model, ctx.tokenizer)
        return QwenMTPSession(self, ctx)

    def batch(self, ctx: BatchContext) -> QwenMTPBatch:
        """The head caches of a batch's rows as one batch cache."""
        if self.module is None or self._target is not ctx.model:
            self.attach(ctx.model, ctx.tokenizer)
        return QwenMTPBatch(self, ctx)


class QwenMTPSession(BaseDrafterSession):
    """One request's MTP cache, pending hidden states and depth."""

    def __init__(self, drafter: QwenMTPDrafter, ctx: RequestContext) -> None:
        self.d = drafter
        self.module = drafter.module
        self.cache = self.module.make_cache()
        self.embed = text_model(ctx.model).model.embed_tokens
        if ctx.head is None:
            raise specdec.PolicyError(
                f"{NAME}: no draft head was handed over (head option {drafter.head!r})"
            )
        self.head = ctx.head
        self.sampler = ctx.sampler
        self.tokens: list[int] = list(ctx.prompt_tokens)  # prompt + committed
        # head cache entries: positions cached .. fed-1. A request that starts from a
        # prompt_cache has no hidden states for the positions it held: the head's own
        # cache starts at the first position prefilled (attention is relative, so a
        # shorter context for the head, never a wrong position).
        self.cached = ctx.cached
        self.fed = ctx.cached
        self.pending: list[mx.array] = []  # true hidden rows for positions fed, fed+1, ...
        self.pending_n = 0
        self.seed: mx.array | None = None  # head output at position fed-1 (predicts fed+1)
        self.adapt = AdaptiveDepth(
            drafter.depth,
            drafter.max_depth,
            adaptive=drafter.adaptive,
            grow_at=drafter.grow_at,
            shrink_below=drafter.shrink_below,
            window=drafter.window,
        )
        self.depth = drafter.depth
        self.last: tuple[int, int] | None = None  # (start position, drafted) of our proposal
        self.rounds = 0
        self.proposed = 0
        self.accepted_total = 0
        self.gaps = 0
        self.broken = False
        self.batched = False  # its head cache became a row of a QwenMTPBatch

    # -- feeding the head -------------------------------------------------------------

    def _add_hidden(self, start: int, rows: mx.array) -> None:
        have = self.fed + self.pending_n
        if start > have:
            self.gaps += 1
            self.broken = True  # positions whose hidden states never came: stop drafting
            return
        skip = have - start
        if skip >= rows.shape[0]:
            return
        self.pending.append(rows[skip:])
        self.pending_n += rows.shape[0] - skip

    def pairs(self, upto: int) -> tuple[mx.array, mx.array] | None:
        """The pending (hidden row, next token) pairs for positions ``fed .. upto`` as
        ``(hidden [n, H], token embeddings [n, H])``, ``None`` when some are not known
        yet; nothing is fed."""
        n = upto + 1 - self.fed
        if n <= 0 or self.pending_n < n or len(self.tokens) < upto + 2:
            return None
        hid = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=0)
        toks = mx.array(self.tokens[self.fed + 1 : upto + 2])
        return hid[:n], self.embed(toks)

    def fed_pairs(self, n: int, seed: mx.array) -> None:
        """``n`` pending pairs went through the head; its last output is ``seed``."""
        hid = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending, axis=0)
        rest = hid[n:]
        self.pending = [rest] if rest.shape[0] else []
        self.pending_n -= n
        self.fed += n
        self.seed = seed

    def _catch_up(self, upto: int) -> bool:
        """Feed the pending pairs for positions ``fed .. upto`` (needs ``x[upto+1]``)."""
        n = upto + 1 - self.fed
        if n <= 0:
            return n == 0 and self.seed is not None  # caught up already
        got = self.pairs(upto)
        if got is None:
            return False
        hid, emb = got
        out = self.module(emb[None], hid[None], self.cache)
        self.fed_pairs(n, out[0, -1:])
        return True

    def prefill(self, chunk: PrefillChunk) -> None:
        """Keep the chunk's hidden states and run the head over the pairs they complete."""
        h = chunk.result.hidden
        if h is None:
            return
        self._add_hidden(chunk.start_position, h)
        # Every prompt token is known: positions up to the chunk's last can be fed.
        end = chunk.start_position + len(chunk.tokens) - 1
        if end + 1 < len(self.tokens) and self._catch_up(end):
            mx.eval([c.state for c in self.cache])

    # -- the Drafter protocol ---------------------------------------------------------

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Catch up to ``len(history) - 2`` and draft ``min(max_len, depth)`` tokens (lazily)."""
        k = min(max_len, self.depth)
        n = len(history)
        if k < 1 or self.broken or n < 2:
            return None
        if len(self.tokens) != n:
            self.tokens = list(history)
        if not self._catch_up(n - 2) or self.fed != n - 1 or self.seed is None:
            return None
        greedy = self.sampler.is_greedy or self.d.sampled_drafts == "greedy"
        state = [self.seed]  # the head's output state feeding the next step

        def step(i: int, previous: Any) -> mx.array:
            if previous is not None:
                state[0] = self.module(self.embed(previous)[None], state[0][None], self.cache)[0]
            return self.head.logits(state[0], context=history)  # [1, V]

        draft = specdec.drafting.draft_lazily(k, step, self.sampler, n, greedy=greedy)
        if k > 1:
            for c in self.cache:  # the recursive entries were built from guesses
                c.trim(k - 1)
        self.last = (n, k)
        self.rounds += 1
        self.proposed += k
        return draft

    def observe(self, result: RoundResult) -> None:
        """Keep the hidden rows of the accepted tokens; score our own proposal; adapt depth."""
        start = result.start_position
        if self.last is not None and self.last[0] == start and result.drafter == NAME:
            self._score(len(result.block), result.n_accepted)
        self.last = None
        if len(self.tokens) >= start:  # else propose() takes the history as it is
            self.tokens[start:] = list(result.committed)
        v = result.verify
        if v is not None and v.hidden is not None:
            self._add_hidden(start - 1, v.hidden[: result.n_accepted + 1])
        if (
            not self.batched
            and self.pending_n > _MAX_PENDING
            and self._catch_up(len(self.tokens) - 2)
        ):
            # Evaluate now: a lazy catch-up would keep the rows and the graph alive.
            mx.async_eval([c.state for c in self.cache] + [self.seed])

    def _score(self, k: int, a: int) -> None:
        self.accepted_total += a
        self.depth = self.adapt.observe(k, a)

    def end(self) -> None:
        """Drop the head cache and pending states."""
        self.cache = []
        self.pending = []
        self.pending_n = 0
        self.seed = None

    def stats(self) -> dict:
        """Rounds, depth now and its changes, per-position acceptance, what was loaded."""
        return {
            "mtp_rounds": self.rounds,
            "mtp_proposed": self.proposed,
            "mtp_accepted": self.accepted_total,
            **self.adapt.stats(),
            "hidden_gaps": self.gaps,
            "head_context_from": self.cached,
            "batched": self.batched,
            "mtp": dict(self.d.info),
        }


class QwenMTPBatch(BatchRows):
    """The head caches of a :class:`specdec.Batch`'s rows as one ``BatchKVCache`` per MTP
    layer (a :class:`specdec.roles.DrafterBatch`).

    ``propose``: every row's pending pairs (asking or not) in one right-padded head call,
    the padding dropped per row (``batch_kv``); then, from each asking row's seed, one
    head call per recursion step for all rows, its ``depth - 1`` recursive entries
    dropped by one uniform trim (every row got as many). The rows' bookkeeping stays in
    their :class:`QwenMTPSession` objects.
    """

    def __init__(self, drafter: QwenMTPDrafter, ctx: BatchContext) -> None:
        super().__init__()
        self.d = drafter
        self.module = drafter.module
        self.sessions: dict[int, QwenMTPSession] = {}
        self.calls = 0  # head calls run (each for every row), for tests and stats
        self.joint_rounds = 0  # rounds in which two rows or more drafted in the same calls

    def join(self, row: int, session: QwenMTPSession) -> None:
        """The row's head cache becomes a row of the batch's."""
        self.add_row(row, session.cache)
        session.cache = []
        session.batched = True
        self.sessions[row] = session

    def leave(self, rows: Sequence[int]) -> None:
        """Drop the rows' entries (mlx-lm's ``filter``)."""
        for r in self.drop_rows(rows):
            del self.sessions[r]

    def _catch_up(self, upto: dict[int, int]) -> None:
        """Feed every row its pending pairs up to ``upto[row]`` (the most it can where
        absent), in one right-padded head call."""
        feeds: list[tuple[mx.array, mx.array] | None] = []
        for r in self.rows:
            s = self.sessions[r]
            last = upto.get(r, min(len(s.tokens) - 2, s.fed + s.pending_n - 1))
            feeds.append(s.pairs(last) if last >= s.fed else None)
        width = max((f[0].shape[0] for f in feeds if f is not None), default=0)
        if width == 0:
            return
        some = next(f for f in feeds if f is not None)[0]
        hid, emb, lengths = [], [], []
        for f in feeds:
            n = 0 if f is None else f[0].shape[0]
            lengths.append(n)
            pad = mx.zeros((width - n, some.shape[-1]), dtype=some.dtype)
            hid.append(pad if f is None else mx.concatenate([f[0], pad]))
            emb.append(
                pad.astype(some.dtype)
                if f is None
                else mx.concatenate([f[1], pad.astype(f[1].dtype)])
            )
        txns = [BatchKVRollback().begin(c) for c in self.caches]
        try:
            out = self.module(mx.stack(emb), mx.stack(hid), self.caches)
            for t in txns:
                t.commit(width, lengths)
        except BaseException:
            for t in txns:
                t.abort()
            raise
        self.calls += 1
        for i, (r, n) in enumerate(zip(self.rows, lengths)):
            if n:
                self.sessions[r].fed_pairs(n, out[i, n - 1 : n])

    def propose(self, asks: Sequence[Ask], caches: list) -> list[Draft | None]:
        """Catch every row up, then draft each asking row's ``min(max_len, depth)`` tokens
        together (lazily); the target's ``caches`` are not read."""
        want: dict[int, tuple[Ask, int]] = {}
        for a in asks:
            s = self.sessions[a.row]
            k, n = min(a.max_len, s.depth), len(a.history)
            if k < 1 or s.broken or n < 2:
                continue
            if len(s.tokens) != n:
                s.tokens = list(a.history)
            want[a.row] = (a, k)
        self._catch_up({r: len(a.history) - 2 for r, (a, _) in want.items()})
        ready = {
            r: (a, k)
            for r, (a, k) in want.items()
            if self.sessions[r].fed == len(a.history) - 1 and self.sessions[r].seed is not None
        }
        drafts: dict[int, Draft] = {}
        if ready:
            drafts = self._draft(ready)
        return [drafts.get(a.row) for a in asks]

    def _draft(self, ready: dict[int, tuple[Ask, int]]) -> dict[int, Draft]:
        """The recursion for the rows in ``ready`` (every row of the cache steps)."""
        steps = max(k for _, k in ready.values())
        self.joint_rounds += len(ready) > 1
        state = []
        for r in self.rows:
            s = self.sessions[r]
            state.append(
                s.seed if r in ready else mx.zeros_like(next(iter(ready.values()))[0].session.seed)
            )
        state_b = mx.concatenate(state)  # [B, H]
        tokens: dict[int, list] = {r: [] for r in ready}
        qs: dict[int, list] = {r: [] for r in ready}
        pad = mx.zeros((1,), mx.int32)
        # The recursive entries were built from guesses: every row drops all of them
        # (one uniform trim), also when a step raises.
        txns = [BatchKVRollback().begin(c) for c in self.caches]
        try:
            for i in range(steps):
                if i:
                    y = mx.concatenate([tokens[r][-1] if r in ready else pad for r in self.rows])
                    emb = self.sessions[next(iter(ready))].embed(y)
                    state_b = self.module(emb[:, None], state_b[:, None], self.caches)[:, 0]
                    self.calls += 1
                for b, r in enumerate(self.rows):
                    if r not in ready or i >= ready[r][1]:
                        continue
                    a, _ = ready[r]
                    s = self.sessions[r]
                    logits = s.head.logits(state_b[b : b + 1], context=a.history)
                    greedy = s.sampler.is_greedy or self.d.sampled_drafts == "greedy"
                    y_r, q = draw(logits, s.sampler, len(a.history) + i, greedy=greedy)
                    if q is not None:
                        qs[r].append(q)
                    tokens[r].append(y_r.astype(mx.int32))
                mx.async_eval([t[-1] for t in tokens.values()])
        except BaseException:
            for t in txns:
                t.abort()
            raise
        for t in txns:
            t.commit(steps - 1, 0)
        out = {}
        for r, (a, k) in ready.items():
            s = self.sessions[r]
            s.last = (len(a.history), k)
            s.rounds += 1
            s.proposed += k
            probs = mx.stack(qs[r]) if qs[r] else None
            out[r] = Draft(tokens=mx.concatenate(tokens[r]), probs=probs)
        return out

    def observe(self, results: dict[int, RoundResult]) -> None:
        """Rows whose pending hidden rows passed the bound are caught up (rounds other
        drafters won); the sessions take the round's rows themselves."""
        if any(self.sessions[r].pending_n > _MAX_PENDING for r in self.rows):
            self._catch_up({})
            mx.async_eval([c.state for c in self.caches])

    def end(self) -> None:
        """Drop the head caches."""
        self.caches = None
        self.rows, self.sessions = [], {}


def create_qwen_mtp(**options: Any) -> QwenMTPDrafter:
    """Factory registered as ``qwen_mtp``.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    return QwenMTPDrafter(**options)
