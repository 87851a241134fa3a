"""Batched speculation: several requests decoded as the rows of one target forward.

A :class:`Batch` holds up to ``max_rows`` requests. Each row keeps its own
drafter and governor sessions, sampler, stop set and statistics; every round
asks each row's sessions for a block, feeds ``[last, *block]`` of every row in
one forward over a right-padded ``[B, 1 + k_max]`` input, accepts each row on
its own (ragged acceptance) and rolls each row's cache back to what it
accepted. Requests join between rounds (their prompt is prefilled alone, then
their cache is merged into the batch's) and rows that finish, fail or are
cancelled leave it: continuous batching.

The batch's caches are mlx-lm's batch caches (``BatchKVCache`` for attention
layers). Rolling back rows by different amounts keeps the cache rectangular:
all rows drop the rejected tail they share, and a row that keeps fewer entries
than the row that keeps most moves its oldest entries into the holes at its end
and grows its left padding by as many (the entries of a cache are keys already
rotated at their positions, so attention does not depend on their order): a few
entries per row move, never the whole cache (see :class:`specdec.rollback.BatchKVRollback`).
Sliding-window layers (``BatchRotatingKVCache``) need their entries in temporal
order: there each row is rolled right by what it rejected beyond the tail all rows
rejected (:class:`specdec.rollback.BatchRotatingRollback`).

Each row's sessions see their round's :class:`specdec.VerifyResult` as a single
request's (``RoundResult.verify``: the row's slice of the batch forward's logits,
hidden states and layers).
"""

from __future__ import annotations

import copy
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from . import guard
from . import round as phases
from .attention import verify_attention
from .composition import check_batch
from .coordinate import Solo
from .costs import best_width
from .errors import PolicyError, RequestError
from .lifecycle import (
    RequestState,
    close,
    open_request,
    prefill,
    prompt_cache_length,
)
from .request import Request
from .roles import Ask, BatchContext, DrafterBatch, RoundResult, optional
from .rollback import BatchKVRollback, build_plan, order_for_block
from .round import Round, RoundKind

__all__ = ["Batch", "BatchEvent", "BatchKVRollback", "CacheSnapshot"]


@attrs.frozen
class CacheSnapshot:
    """A row's caches as one request's (``make_prompt_cache(model)`` layout), for reuse
    as a later request's ``prompt_cache``: what a row added with ``keep_cache=True``
    hands back (:attr:`BatchEvent.caches`).

    Attributes:
        tokens: the token ids the caches hold, in order (the prompt's first tokens,
            then generated ones).
        caches: the per-layer caches, the caller's own (the batch keeps no reference).
        ordered: whether the entries are in position order, so the caches may be
            trimmed to a prefix of ``tokens`` (``mlx_lm.models.cache.trim_prompt_cache``).
            A row whose rollback kept fewer entries than another row's in some round
            may hold its entries in another order (``batch_kv`` moves a few to fill
            holes; attention does not depend on the order): such caches serve only as
            a whole, as the prefix of a longer prompt.
    """

    tokens: tuple[int, ...]
    caches: list
    ordered: bool


@attrs.frozen
class BatchEvent:
    """What a :meth:`Batch.step` produced for one row.

    Attributes:
        row: the id :meth:`Batch.add` returned.
        response: a committed token (the last one has ``finish_reason``), or ``None``.
        error: the exception that ended this row's request (its prompt could not be
            prefilled, a drafter or the acceptor raised, or the round's forward
            failed), or ``None``. The other rows go on.
        caches: for a row added with ``keep_cache=True``, its caches: the prompt's
            (taken when the prompt has been prefilled, on the row's first event) and
            the whole request's (prompt and generated tokens, on its last event); empty
            otherwise.
    """

    row: int
    response: Any = None
    error: BaseException | None = None
    caches: tuple[CacheSnapshot, ...] = ()


@attrs.define
class _Member:
    rid: int
    state: RequestState
    cancelled: bool = False
    prompt_cache: Any = None
    keep_cache: bool = False
    #: snapshots for the row's next event (keep_cache)
    snapshots: list = attrs.Factory(list)
    #: some round kept fewer of this row's entries than of another row's, or the row
    #: started from an unordered snapshot: its entries may be out of position order
    ragged: bool = False
    #: the drafters whose batch state (``DrafterBatch``) holds this row
    joined: list = attrs.Factory(list)
    #: the error of a drafter's batch state that failed while holding this row (the row
    #: fails at its next round)
    lost: BaseException | None = None


def _held(caches: list) -> int | None:
    """The tokens every layer of a request's caches holds, or ``None`` when a layer
    does not tell or they differ."""
    lengths = {getattr(c, "offset", None) for c in caches}
    if len(lengths) != 1:
        return None
    n = lengths.pop()
    return n if isinstance(n, int) else None


def _merged(caches: list) -> list:
    """A request's prefilled caches as one-row batch caches (mlx-lm's ``merge``)."""
    out = []
    for i, c in enumerate(caches):
        merge = getattr(type(c), "merge", None)
        if merge is None:
            raise PolicyError(
                f"the model's cache {type(c).__name__} (layer {i}) cannot be batched: mlx-lm "
                "gives it no merge(); decode one request at a time (max_batch = 1)"
            )
        out.append(merge([c]))
    return out


class Batch:
    """Requests decoded together as the rows of one target forward per round.

    Made by :meth:`specdec.Pipeline.batch`. :meth:`add` queues a request (its
    arguments are checked at once, before any model work), :meth:`step` admits
    queued requests while there is room and runs one round for every row, and
    :meth:`cancel` frees a row at the next round. The batch is run by one thread.

    Speculation runs in a batch when every layer's cache has a rollback with
    ``supports_batch`` (the built-in ``batch_kv`` for ``BatchKVCache``,
    ``batch_rotating`` for sliding-window layers); otherwise
    the rows decode plainly, together, and their ``stats.speculation_off_reason``
    says why.
    """

    def __init__(self, pipeline: Any, max_rows: int):
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise RequestError(f"a batch needs max_rows >= 1, got {max_rows!r}")
        self.pipeline = pipeline
        self.max_rows = max_rows
        check_batch(pipeline.host, pipeline.policy, max_rows)
        verify = optional(pipeline.verifier, "verifier", "verify_batch")
        if not callable(verify):
            raise PolicyError(
                f"verifier {pipeline.verifier.name!r} has no verify_batch(model, tokens, "
                "caches): it cannot verify rows of a batch"
            )
        self._verify = verify
        probe = _merged(make_prompt_cache(pipeline.model))
        plan = build_plan(pipeline.host, probe, model=pipeline.model, policy=pipeline.policy)
        #: why the rows of this batch cannot speculate (``None``: they can).
        self.off_reason: str | None = None
        if not plan.ok:
            self.off_reason = f"in a batch: {plan.reason}"
        else:
            unable = [
                r.name for r in plan.assigned if not optional(r, "cache_rollback", "supports_batch")
            ]
            if unable:
                self.off_reason = (
                    f"cache rollback {unable[0]!r} cannot roll back rows of a batch by "
                    "different amounts (it does not set supports_batch)"
                )
        #: rounds run (one target forward each) and their time, for servers' metrics.
        self.rounds = 0
        self.round_time_s = 0.0
        #: ``{rows: {width: rounds}}``: the tokens fed per row in each round, by the rows
        #: the round had (the batch's sizing, see :meth:`_size`).
        self.widths: dict[int, dict[int, int]] = {}
        #: the verify cost curves that size a round's blocks for the whole batch (the
        #: pipeline's, when a drafter reads it; ``None``: blocks verified as proposed)
        self._cost = pipeline.cost_model if pipeline.policy.batch_sizing == "width" else None
        #: seconds a round costs beyond its forward (an average of the last rounds;
        #: ``None`` before the first)
        self._overhead_s: float | None = None
        #: seconds the current round spent profiling a batch's verify cost (not overhead)
        self._profiling_s = 0.0
        self._pending: deque[_Member] = deque()
        self._rows: list[_Member] = []
        self._caches: list | None = None
        self._plan: Any = None
        self._next = 0
        #: the drafters' batch states (drafters with ``batch``), made with the first row
        self._drafting: dict[str, DrafterBatch] = {}
        self._drafter_batches()

    # -- queue ------------------------------------------------------------------

    def add(
        self,
        prompt: str | Sequence[int],
        *,
        prompt_cache: list | CacheSnapshot | None = None,
        keep_cache: bool = False,
        request: Request | None = None,
        **kwargs: Any,
    ) -> int:
        """Queue a request; ``kwargs`` as :meth:`specdec.Pipeline.stream` (but ``on_round``),
        or a :class:`specdec.Request` as ``request``.

        Args:
            prompt: text or token ids.
            prompt_cache: the model's per-layer caches (``make_prompt_cache(model)``)
                holding the prompt's first tokens (at most all but the last), e.g.
                computed once for many requests with the same prompt or prefix: the row
                starts from a copy of it (the given caches are never written) and
                prefills only the rest (drafter sessions see ``ctx.cached``; prompt
                chunks reach their ``prefill`` from that position on). Or a
                :class:`CacheSnapshot` (a row's caches handed back, trimmed or not):
                its tokens must be the prompt's first tokens, and an unordered one
                makes this row's snapshots unordered too (the entries it holds stay
                where they were).
            keep_cache: hand the row's caches back as :class:`CacheSnapshot` objects
                (:attr:`BatchEvent.caches`): the prompt's once it is prefilled, the
                whole request's when it finishes (not when it fails or is cancelled),
                e.g. for a server's prefix cache.

        Returns:
            the row id its :class:`BatchEvent` objects carry.

        Raises:
            RequestError: a bad argument, before any model work.
        """
        if "on_round" in kwargs:
            raise RequestError("on_round is not available for rows of a batch")
        state = self.pipeline.request_state(prompt, request, kwargs)
        if not isinstance(keep_cache, bool):
            raise RequestError(f"keep_cache must be True or False, got {keep_cache!r}")
        ordered = True
        if isinstance(prompt_cache, CacheSnapshot):
            snap = prompt_cache
            if tuple(state.history[: len(snap.tokens)]) != snap.tokens:
                raise RequestError(
                    f"prompt_cache holds {len(snap.tokens)} tokens that are not the prompt's "
                    "first tokens"
                )
            prompt_cache, ordered = snap.caches, snap.ordered
        if prompt_cache is not None:
            held = prompt_cache_length(self.pipeline.model, prompt_cache, len(state.history))
            state.cached = state.stats.cached_tokens = held
        rid = self._next
        self._next += 1
        self._pending.append(
            _Member(
                rid, state, prompt_cache=prompt_cache, keep_cache=keep_cache, ragged=not ordered
            )
        )
        return rid

    def cancel(self, rid: int) -> bool:
        """Drop a request: a queued one at once, a running one before the next round.
        Returns whether ``rid`` was queued or running."""
        for m in self._pending:
            if m.rid == rid:
                self._pending.remove(m)
                return True
        for m in self._rows:
            if m.rid == rid:
                m.cancelled = True
                return True
        return False

    @property
    def running(self) -> int:
        """Rows in the batch now."""
        return len(self._rows)

    @property
    def queued(self) -> int:
        """Requests waiting for a row."""
        return len(self._pending)

    def __len__(self) -> int:
        return len(self._rows) + len(self._pending)

    def close(self) -> None:
        """End every request (their sessions end; queued ones are dropped)."""
        for m in self._rows:
            close(m.state)
        self._rows = []
        self._pending.clear()
        self._caches = self._plan = None
        self._end_drafting()

    def _end_drafting(self, names: Sequence[str] | None = None) -> None:
        """End the drafters' batch states, or those of ``names`` (warning for one that
        raises)."""
        for name in list(self._drafting if names is None else names):
            db = self._drafting.pop(name)
            try:
                db.end()
            except Exception as exc:  # noqa: BLE001 - the batch is closing anyway
                warnings.warn(
                    f"drafter {name!r}: its batch state raised in end(): {exc!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _drafter_batches(self, state: RequestState | None = None) -> dict[str, DrafterBatch]:
        """The batch state of each of the policy's drafters that has ``batch``, made where
        missing (none when the rows cannot speculate).

        Raises:
            PolicyError: a drafter's ``batch`` raised, when the batch is made (no ``state``).
            ComponentError: it raised when ``state``'s row joins (that row fails).
        """
        if self.off_reason is not None:
            return self._drafting
        pipe = self.pipeline
        for d in pipe.drafters:
            make = optional(d, "drafter", "batch")
            if make is None or d.name in self._drafting:
                continue
            ctx = BatchContext(
                model=pipe.model,
                tokenizer=pipe.tokenizer,
                options=pipe.policy.options_for(d.name),
                host=pipe.host,
                verifier=pipe.verifier,
                max_rows=self.max_rows,
            )
            try:
                self._drafting[d.name] = make(ctx)
            except Exception as exc:
                if state is not None:
                    guard.blame(state, "drafter", d.name, "batch", exc, None)
                if isinstance(exc, PolicyError):
                    raise
                raise PolicyError(
                    f"drafter {d.name!r} cannot draft for the rows of a batch: {exc}"
                ) from exc
        return self._drafting

    # -- admission ----------------------------------------------------------------

    def step(self) -> list[BatchEvent]:
        """Admit queued requests while there is room, then run one round for every row.

        Returns:
            the round's events, in row order: committed tokens, finished and failed
            requests.
        """
        self._drop([m for m in self._rows if m.cancelled])
        events: list[BatchEvent] = []
        joined = []
        while self._pending and len(self._rows) < self.max_rows:
            m = self._pending.popleft()
            try:
                self._admit(m)
                joined.append(m)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                close(m.state)
                events.append(BatchEvent(m.rid, error=exc))
        now = time.perf_counter()
        for m in joined:  # decoding starts when every joining prompt has been prefilled
            m.state.t_start = now
        if self._rows:
            events.extend(self._round())
        return events

    def _admit(self, m: _Member) -> None:
        pipe, state = self.pipeline, m.state
        open_request(pipe, state, off_reason=self.off_reason, row=m.rid, reset_peak=not self._rows)
        if m.prompt_cache is None:
            prefill(pipe, state, Solo())
            merged = _merged(state.caches)
        elif state.cached < len(state.history) - 1:  # a prefix: prefill the rest on a copy
            state.caches = copy.deepcopy(m.prompt_cache)
            prefill(pipe, state, Solo())
            merged = _merged(state.caches)
        else:
            merged = _merged(m.prompt_cache)  # copies: the given caches stay as they were
        if m.keep_cache and state.caches is not m.prompt_cache:
            # the prefilled caches: the merge copied them, nothing writes them again
            n = _held(state.caches)
            if n is not None:
                snap = CacheSnapshot(tuple(state.history[:n]), state.caches, not m.ragged)
                m.snapshots.append(snap)
        self._join_drafting(m)
        if self._caches is None:
            try:
                plan = build_plan(pipe.host, merged, model=pipe.model, policy=pipe.policy)
                mx.eval([c.state for c in merged])
            except BaseException:
                self._leave_drafting([m])
                raise
            self._caches, self._plan = merged, plan
        else:
            saved = [c.state for c in self._caches]
            try:
                for c, o in zip(self._caches, merged):
                    c.extend(o)
                mx.eval([c.state for c in self._caches])
            except BaseException:  # the other rows' caches stay as they were
                for c, st in zip(self._caches, saved):
                    c.state = st
                self._leave_drafting([m])
                raise
        state.caches = self._caches
        state.stats.rollbacks = self._plan.names() if self.off_reason is None else []
        self._rows.append(m)

    def _join_drafting(self, m: _Member) -> None:
        """Hand row ``m``'s sessions of drafters with a batch state over to it (after its
        prompt was prefilled alone).

        Raises:
            ComponentError: a drafter's ``join`` raised (the row joined no batch state).
        """
        drafting = self._drafter_batches(m.state)
        for name, s in m.state.sessions:
            db = drafting.get(name)
            if db is None:
                continue
            try:
                db.join(m.rid, s)
            except Exception as exc:
                self._leave_drafting([m])
                guard.blame(m.state, "drafter", name, "join", exc, None)
            m.joined.append(name)

    def _leave_drafting(self, gone: list[_Member]) -> None:
        """Tell the drafters' batch states that rows are gone."""
        for name, db in list(self._drafting.items()):
            rows = [m.rid for m in gone if name in m.joined]
            if not rows:
                continue
            for m in gone:
                if name in m.joined:
                    m.joined.remove(name)
            try:
                db.leave(rows)
            except Exception as exc:  # noqa: BLE001 - its other rows cannot draft any more
                self._lose(name, "leave", exc)

    def _lose(self, name: str, call: str, exc: BaseException) -> None:
        """Drafter ``name``'s batch state raised in ``call`` and cannot be trusted: it is
        ended, every row it held fails at its next round with that error (named), and
        rows that join later get a new one."""
        for m in self._rows:
            if name in m.joined:
                m.joined.remove(name)
                if m.lost is None:
                    position = len(m.state.history)
                    m.lost = guard.component_error(m.state, "drafter", name, call, exc, position)
                    m.lost.__cause__ = exc
        self._end_drafting([name])

    def _drop(self, gone: list[_Member]) -> None:
        """Remove rows from the batch (their sessions end; the caches keep the others)."""
        if not gone:
            return
        self._leave_drafting(gone)
        for m in gone:
            close(m.state)
        keep = [i for i, m in enumerate(self._rows) if m not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._caches = self._plan = None
            return
        for c in self._caches:
            c.filter(keep)

    # -- a round ------------------------------------------------------------------

    def _round(self) -> list[BatchEvent]:
        """Plan every row, one padded verify forward, accept each row, commit the caches
        with one keep count per row, observe and emit."""
        members = list(self._rows)
        failed: dict[int, BaseException] = {}
        t_start = time.perf_counter()
        rounds = self._plan_rows(members, failed)
        width = max(r.n_fed for r in rounds)
        by_width = self.widths.setdefault(len(members), {})
        by_width[width] = by_width.get(width, 0) + 1
        rows = [
            [m.state.history[-1], *r.block] + [m.state.history[-1]] * (width - r.n_fed)
            for m, r in zip(members, rounds)
        ]
        order_for_block(self._caches, width)
        txn = self._plan.begin()
        t0 = time.perf_counter()
        try:
            with verify_attention():
                vr = self._verify(self.pipeline.model, mx.array(rows, dtype=mx.int32), self._caches)
            logits = vr.logits
            mx.eval(logits)
        except Exception as exc:  # noqa: BLE001 - the forward is every row's: all fail
            return self._fail_all(exc, failed)
        t_verify = time.perf_counter()
        keeps, results, accept_s = [], [], []
        for i, (m, rnd) in enumerate(zip(members, rounds)):
            res = None
            t = time.perf_counter()
            if i not in failed:
                try:
                    rnd.vr = vr.row(i, rnd.n_fed)
                    res = self._accept(m.state, rnd, rnd.vr.logits)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[i] = exc
            accept_s.append(time.perf_counter() - t)
            keeps.append(1 if res is None else res.n_accepted + 1)
            results.append(res)
        for m, k in zip(members, keeps):
            m.ragged = m.ragged or k < max(keeps)
        t_commit = time.perf_counter()
        try:
            # One count for all rows when they all keep the same (always so without
            # drafts): rollbacks without per-row support take it too.
            txn.commit(width, keeps[0] if len(set(keeps)) == 1 else keeps)
        except Exception as exc:  # noqa: BLE001 - the caches are every row's: all fail
            return self._fail_all(exc, failed)
        self._observe_drafting(members, results, failed)
        t_done = time.perf_counter()
        self.rounds += 1
        self.round_time_s += t_done - t0
        # planning, acceptance, commit: not the forward, nor profiling a batch's curve
        outside = (t_done - t_start) - (t_verify - t0) - self._profiling_s
        self._profiling_s = 0.0
        last = self._overhead_s
        self._overhead_s = outside if last is None else last + 0.2 * (outside - last)
        events: list[BatchEvent] = []
        gone = []
        for i, (m, rnd, res) in enumerate(zip(members, rounds, results)):
            stats = m.state.stats
            # Each row counts the shared forward and commit in full, and its own acceptance.
            stats.wait_time_s += t_verify - t0 + accept_s[i]
            if rnd.block:
                stats.verify_time_s += t_verify - t0 + accept_s[i]
                stats.commit_time_s += t_done - t_commit
            stats.batch_rows[len(members)] = stats.batch_rows.get(len(members), 0) + 1
            if res is not None:
                try:
                    events.extend(self._emit(i, m, rnd, res))
                    if m.state.emitter.done:
                        gone.append(m)
                    continue
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[i] = exc
            events.append(BatchEvent(m.rid, error=failed[i]))
            gone.append(m)
        self._drop(gone)
        return events

    def _emit(self, i: int, m: _Member, rnd: Round, res: RoundResult) -> list[BatchEvent]:
        """Row ``i``'s round told to its sessions and emitted; its last event carries the
        caches it hands back (``keep_cache``)."""
        phases.observe(m.state, res)
        em = m.state.emitter
        logprobs = phases.token_logprobs(m.state, rnd.logits, res.committed)
        out = em.push(res.committed, res.n_accepted, res.start_position, logprobs)
        if m.keep_cache and em.done:
            try:
                m.snapshots.append(self._extract(i, m))
            except Exception as exc:  # noqa: BLE001 - the request is done anyway
                warnings.warn(
                    f"row {m.rid}: its caches could not be handed back (keep_cache): {exc!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )
        events = [BatchEvent(m.rid, response=r) for r in out[:-1]]
        if out:
            events.append(BatchEvent(m.rid, response=out[-1], caches=self._snap(m)))
        return events

    @staticmethod
    def _snap(m: _Member) -> tuple[CacheSnapshot, ...]:
        """The snapshots waiting for ``m``'s next event (taken from it)."""
        out = tuple(s for s in m.snapshots if s is not None)
        m.snapshots.clear()
        return out

    def _extract(self, i: int, m: _Member) -> CacheSnapshot | None:
        """Row ``i``'s caches as one request's (``None`` where a layer's batch cache
        has no ``extract``)."""
        caches = self._caches or []
        if not all(callable(getattr(c, "extract", None)) for c in caches):
            return None
        own = [c.extract(i) for c in caches]
        for c in own:  # own buffers: a slice (a view) would keep the batch's alive
            if isinstance(c, (KVCache, RotatingKVCache)) and c.keys is not None:
                c.keys, c.values = c.keys * 1, c.values * 1
        mx.eval([c.state for c in own])
        n = _held(own)
        if n is None:
            return None
        return CacheSnapshot(tuple(m.state.history[:n]), own, not m.ragged)

    def _plan_rows(self, members: list[_Member], failed: dict[int, BaseException]) -> list[Round]:
        """Every row's round: its block planned (:func:`specdec.round.plan_steps`; the
        asks of all rows for a drafter with a batch state answered in one ``propose``),
        then read back (one host sync for every lazy block) and cut to its grammar. A
        plain row has no block; a row whose drafter or governor raised is fed its last
        token only and fails alone."""
        policy = self.pipeline.policy
        rounds: list[Round] = []
        waiting: dict[int, tuple[Any, Ask]] = {}
        for i, m in enumerate(members):
            state, position = m.state, len(m.state.history)
            plain = not state.sessions and not state.forces
            kind = RoundKind.PLAIN if plain else RoundKind.SPECULATIVE
            rounds.append(Round(kind=kind, position=position))
            if m.lost is not None:  # a drafter's batch state failed while holding it
                failed[i] = m.lost
            elif not plain:
                steps = phases.plan_steps(state, policy, rounds[i])
                self._advance(i, steps, lambda s=steps: next(s, None), waiting, failed)
        order = {d: n for n, d in enumerate(policy.drafters)}
        while waiting:
            # The drafter earliest in the policy first: a row only moves on to later
            # drafters, so each batch state is asked once per round, with every row
            # that reaches it.
            name = min(
                (ask.drafter for _, ask in waiting.values()),
                key=lambda d: order.get(d, len(order)),
            )
            rows = [i for i, (_, ask) in waiting.items() if ask.drafter == name]
            asks = [attrs.evolve(waiting[i][1], index=i) for i in rows]
            answers = self._propose(name, asks)
            for i, answer in zip(rows, answers):
                steps, _ = waiting.pop(i)
                if isinstance(answer, BaseException):
                    call = lambda s=steps, e=answer: s.throw(e)  # noqa: E731
                else:
                    call = lambda s=steps, d=answer: phases.resume(s, d)  # noqa: E731
                self._advance(i, steps, call, waiting, failed)
        blocks = [
            r.block for i, r in enumerate(rounds) if i not in failed and phases.is_lazy(r.block)
        ]
        if blocks:
            try:
                mx.eval(blocks)  # one host sync for every row's lazy block
            except Exception:  # noqa: BLE001 - settle names the row whose block raises
                pass
        for i, (m, rnd) in enumerate(zip(members, rounds)):
            if i not in failed and rnd.kind is RoundKind.SPECULATIVE:
                try:
                    phases.settle(rnd, m.state)
                except Exception as exc:  # noqa: BLE001 - this request fails alone
                    failed[i] = exc
        self._size(members, rounds, failed)
        for i, (m, rnd) in enumerate(zip(members, rounds)):
            try:
                if i not in failed:
                    phases.constrain(m.state, rnd)  # cut to the grammar, masks filled
                    if rnd.kind is RoundKind.SPECULATIVE:
                        phases.count_block(m.state.stats, rnd)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                failed[i] = exc
            if i in failed and rnd.kind is RoundKind.SPECULATIVE:
                rnd = rounds[i] = Round(kind=RoundKind.SPECULATIVE, position=rnd.position)
            phases.choose_acceptor(policy, m.state.sampler, rnd)
            if rnd.kind is RoundKind.SPECULATIVE:
                rnd.n_fed = 1 + len(rnd.block)
        return rounds

    def _size(self, members: list[_Member], rounds: list[Round], failed: dict) -> None:
        """Cut the blocks that carry acceptance estimates to the width that pays for the
        batch as a whole (:func:`specdec.costs.best_width` over every row, with the
        batch's verify cost curve): each row sized its block as if alone, but every row
        is fed as many tokens as the widest. A block without estimates is kept whole
        (the width is at least its); a row's other blocks count at the acceptance rate
        its drafter has had so far."""
        cm = self._cost
        if cm is None or len(members) < 2 or self.off_reason is not None:
            return
        probs: list[Sequence[float]] = []
        least, cuttable = 1, []
        for i, (m, rnd) in enumerate(zip(members, rounds)):
            if i in failed:
                continue  # fed its last token, but it commits nothing
            k = rnd.block_size
            if not k:
                probs.append(())
                continue
            # a grammar's forced tokens are never cut (they are certain to be accepted)
            least = max(least, 1 + rnd.forced)
            if rnd.acceptance is not None:
                probs.append(rnd.acceptance)
                cuttable.append(i)
            else:
                least = max(least, 1 + k)
                d = m.state.stats.per_drafter.get(rnd.chosen) or {}
                rate = d.get("accepted", 0) / d["drafted"] if d.get("drafted") else 0.5
                probs.append([rate] * k)
        if not cuttable or max(rounds[i].block_size for i in cuttable) < least:
            return  # nothing may be cut, or nothing cut would narrow the forward
        context = max(len(m.state.history) for m in members)
        rows = len(members)
        t0 = time.perf_counter()
        known = cm.batch_cost(rows, 1, context)  # profiles a batch size not seen yet
        self._profiling_s += time.perf_counter() - t0
        if known is None:  # no curve for this batch
            return
        choice = best_width(
            probs,
            lambda w: cm.batch_cost(rows, w, context) or 0.0,
            overhead_s=self._overhead_s or 0.0,
            least=least,
        )
        for i in cuttable:
            k = rounds[i].block_size
            if k > choice.size:
                phases.cut(rounds[i], choice.size)
                members[i].state.stats.batch_cut += k - choice.size

    def _advance(
        self,
        i: int,
        steps: Any,
        call: Any,
        waiting: dict[int, tuple[Any, Ask]],
        failed: dict[int, BaseException],
    ) -> None:
        """Run row ``i``'s plan from ``call`` (its first step, or the answer to its ask):
        sessions without a batch state propose at once; an ask for a drafter with one is
        left in ``waiting``; what the plan raises fails the row."""
        try:
            ask = call()
            while ask is not None and ask.drafter not in self._drafting:
                try:
                    draft = ask.session.propose(ask.history, ask.max_len)
                except Exception as exc:  # noqa: BLE001 - blamed inside, at the ask
                    ask = steps.throw(exc)
                else:
                    ask = phases.resume(steps, draft)
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            failed[i] = exc
            return
        if ask is not None:
            waiting[i] = (steps, ask)

    def _observe_drafting(
        self, members: list[_Member], results: list, failed: dict[int, BaseException]
    ) -> None:
        """Every drafter batch state told the round of each of its rows (after the
        target's commit); one that raises fails its rows (and is made anew for rows
        that join later)."""
        for name, db in list(self._drafting.items()):
            rows = [i for i, m in enumerate(members) if name in m.joined]
            if not rows:
                continue
            took = {members[i].rid: results[i] for i in rows if results[i] is not None}
            try:
                db.observe(took)
            except Exception as exc:  # noqa: BLE001 - its rows fail
                self._lose(name, "observe", exc)
                for i in rows:
                    failed.setdefault(i, members[i].lost or exc)
                    results[i] = None

    def _propose(self, name: str, asks: list[Ask]) -> list[Any]:
        """Drafter ``name``'s batch state asked for every asking row's block at once: a
        draft (or ``None``) per ask, or the exception to throw into each row's plan."""
        try:
            drafts = list(self._drafting[name].propose(asks, self._caches))
        except Exception as exc:  # noqa: BLE001 - every asking row fails with it
            return [exc] * len(asks)
        if len(drafts) != len(asks):
            err = RuntimeError(f"batch propose returned {len(drafts)} drafts for {len(asks)} asks")
            return [err] * len(asks)
        return drafts

    def _fail_all(self, exc: BaseException, failed: dict[int, BaseException]) -> list[BatchEvent]:
        """A failure no row can be blamed for: end every row with it (rows that had
        failed already keep their own error). The round is not undone: the batch's
        caches go with its last row."""
        gone = list(self._rows)
        self._drop(gone)
        return [BatchEvent(m.rid, error=failed.get(i, exc)) for i, m in enumerate(gone)]

    def _accept(self, state: RequestState, rnd: Round, logits: mx.array) -> RoundResult:
        rnd.logits = phases.process(logits, state.history, rnd.block, state.processors)
        if state.grammar is not None:
            rnd.logits = state.grammar.apply(rnd.logits)
        acc = phases.accept(self.pipeline.acceptors, rnd, state.sampler, state)
        phases.check_q(state, rnd, acc.n_accepted)
        phases.commit_grammar(state, acc.n_accepted, acc.token)
        return phases.result(state, rnd, acc.n_accepted, acc.token)


def stream_rows(batch: Batch, prompts: Sequence[Any], kwargs: dict) -> Iterator[tuple[int, Any]]:
    """Queue ``prompts`` in ``batch`` now (bad arguments raise here, before any model
    work) and return an iterator that runs them to the end, yielding ``(prompt index,
    response)``; a row's error is raised there (the other rows end with it)."""
    try:
        ids = {batch.add(p, **kwargs): i for i, p in enumerate(prompts)}
    except BaseException:
        batch.close()
        raise

    def run() -> Iterator[tuple[int, Any]]:
        try:
            while len(batch):
                for ev in batch.step():
                    if ev.error is not None:
                        raise ev.error
                    yield ids[ev.row], ev.response
        finally:
            batch.close()

    return run()
