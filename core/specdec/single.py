"""The single-request driver: one request's rounds, one after another.

It calls the phases of :mod:`specdec.round` in order and alone knows two things
the batch driver does not: *lookahead* (the next plain step queued on a lazily
sampled token while the host finishes this round, as mlx-lm's ``generate_step``
does) and *lazy draft tokens* (a block that stays an unevaluated array until the
round's one host sync). The request's coordinator (:mod:`specdec.coordinate`) is
called at the same points whether the request runs in one process or on ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

from . import guard
from . import round as phases
from .emit import StreamResponse
from .lifecycle import RequestState, close, finish_stats, open_request, prefill, verify
from .roles import RoundResult, VerifyResult
from .round import Round, RoundKind

__all__ = ["SingleDriver"]

#: Rounds in a row without a draft after which the next round is queued ahead, as a
#: plain step (see :meth:`SingleDriver._start_lookahead`).
IDLE_LOOKAHEAD = 2

#: Built-in acceptors that, for an empty block, emit the plain sample of the position
#: (``Sampler.sample`` with the position's key): the lazy sample a lookahead was fed.
_PLAIN_WHEN_EMPTY = frozenset({"greedy", "point_mass", "rejection"})


def _joined(a: VerifyResult, b: VerifyResult) -> VerifyResult:
    """One verify result for two forwards in a row (a lookahead, then a block on it)."""

    def cat(x: Any, y: Any) -> Any:
        return None if x is None or y is None else mx.concatenate([x, y], axis=0)

    return VerifyResult(
        logits=cat(a.logits, b.logits),
        hidden=cat(a.hidden, b.hidden),
        layers={k: cat(v, b.layers[k]) for k, v in a.layers.items() if k in b.layers},
        # project_row's row indices are b's alone (an extended round uses all the logits)
        extras={k: v for k, v in b.extras.items() if k != "project_row"},
    )


class SingleDriver:
    """Runs one request of a :class:`specdec.Pipeline` to its end.

    Args:
        pipe: the pipeline (its components, read through public attributes).
        state: the request's state (:func:`specdec.lifecycle.new_state`).
        coord: the request's coordinator.
        on_round: the debug hook of :meth:`specdec.Pipeline.stream`, or ``None``.
    """

    def __init__(self, pipe: Any, state: RequestState, coord: Any, on_round: Callable | None):
        self.pipe = pipe
        self.state = state
        self.coord = coord
        self.on_round = on_round
        self.plan: Any = None

    def run(self) -> Iterator[StreamResponse]:
        """Open, prefill, decode, close; the coordinator hears of every failure."""
        pipe, state, coord = self.pipe, self.state, self.coord
        try:
            coord.start(state)
            try:
                self.plan = open_request(
                    pipe, state, on_end=lambda reason: finish_stats(pipe, state, coord)
                )
            except BaseException as exc:
                coord.fail(state, exc, opening=True)
                raise
            coord.opened(state)
            prefill(pipe, state, coord)
            yield from self._decode()
            coord.finish(state)
        except GeneratorExit:
            coord.fail(state, None)
            raise
        except BaseException as exc:
            coord.fail(state, exc)
            raise
        finally:
            close(state)

    def _decode(self) -> Iterator[StreamResponse]:
        """Rounds until the stream ends: plan a block, verify, accept, commit, observe, emit.

        With no drafter sessions every round is a plain step, pipelined as in
        mlx-lm: the next round's forward is queued on the lazily sampled token
        before this round's token is read back (after ``on_round`` when one is given).
        """
        state, coord, em = self.state, self.coord, self.state.emitter
        max_tokens = state.request.max_tokens
        plain = not state.sessions and not state.forces
        state.t_start = time.perf_counter()
        queued: Round | None = None
        idle = 0  # rounds in a row that drafted nothing
        clock = _RoundClock(None if plain else state.cost, state)
        while True:
            if queued is None:
                rnd = self._start_round(None)
            elif plain:
                rnd = queued
            else:
                rnd = self._adopt(queued)
            queued = None
            more = self.on_round is None and coord.local and em.n_out + 1 < max_tokens
            can_queue = (
                more
                and self.pipe.lookahead
                and not state.processors
                and state.grammar is None  # its mask needs the token read back first
                and em.n_out + 2 < max_tokens
            )
            if plain and more and state.grammar is None:
                queued = self._start_round(rnd)
            elif can_queue and rnd.chosen is None and idle >= IDLE_LOOKAHEAD:
                # Drafting has paused: queue the next round as a plain step now, as
                # plain decoding does, so the host's work overlaps the forward.
                queued = self._start_lookahead(rnd)
            ended = True
            try:
                res = self._finish_round(rnd)
                clock.tick(rnd, can_queue)
                if queued is not None and queued.kind is RoundKind.LOOKAHEAD:
                    if int(queued.fed.item()) != res.token:
                        # The acceptor drew another token than the lazy sample: undo it.
                        self._undo_lookahead(queued)
                        queued = None
                idle = idle + 1 if res.drafter is None else 0
                phases.observe(state, res)
                if self.on_round is not None:
                    self.on_round(res, state.caches)
                logprobs = phases.token_logprobs(state, rnd.logits, res.committed)
                for r in em.push(res.committed, res.n_accepted, res.start_position, logprobs):
                    t_away = time.perf_counter()
                    yield r
                    state.away_s += time.perf_counter() - t_away  # the consumer's time
                ended = em.done
                coord.round_done()
            finally:
                # An error, the end of the stream, or a consumer that closed it: undo a
                # round queued ahead (plain decoding's queued step has no transaction).
                if ended and queued is not None and queued.kind is RoundKind.LOOKAHEAD:
                    self._undo_lookahead(queued)
            if ended:
                return

    # -- starting rounds ------------------------------------------------------------

    def _start_round(self, after: Round | None) -> Round:
        """Choose a block, open the transaction and queue the verify forward (no host sync).

        ``after``: a plain round whose token is not read back yet; this round follows it
        (fed its lazy token).
        """
        pipe, state, coord = self.pipe, self.state, self.coord
        if not state.sessions and not state.forces:  # a plain step, sampled lazily
            position = len(state.history) + (1 if after is not None else 0)
            tok = after.token if after is not None else mx.array(state.history[-1:])
            coord.round(state, Round(kind=RoundKind.PLAIN, position=position))
            logits = verify(pipe, tok, state.caches).logits
            coord.built(logits)
            if state.processors:
                if after is None:
                    state.history_array = mx.array(state.history)
                else:
                    state.history_array = mx.concatenate([state.history_array, after.token])
                for p in state.processors:
                    logits = p(state.history_array, logits)
            if state.grammar is not None:  # after the processors, as in a round
                state.grammar.advance(())
                logits = state.grammar.apply(logits[-1:])
            y = state.sampler.sample_lazy(logits[-1:], position)
            self._launch(y)
            return Round(
                kind=RoundKind.PLAIN,
                position=position,
                token=y,
                t_launch=time.perf_counter(),
                logits=logits if state.request.logprobs is not None else None,
            )
        rnd = Round(kind=RoundKind.SPECULATIVE, position=len(state.history))
        self._plan(rnd)
        self._launch_round(rnd)
        return rnd

    def _plan(self, rnd: Round) -> None:
        """Plan (a constrained request's block cut to its grammar), coordinate, count the
        block."""
        phases.plan(self.state, self.pipe.policy, rnd)
        try:
            phases.constrain(self.state, rnd)
            self.coord.round(self.state, rnd)
        except BaseException:
            self._undo_grammar()
            raise
        phases.count_block(self.state.stats, rnd)

    def _undo_grammar(self) -> None:
        """A round that failed before it committed: the grammar matcher goes back too."""
        if self.state.grammar is not None:
            self.state.grammar.undo()

    def _launch_round(self, rnd: Round, on: Round | None = None) -> None:
        """Open the transaction and queue the verify forward of ``[last, *block]``.

        ``on``: a lookahead that was fed ``last`` already (see :meth:`_adopt`): only the
        block is fed, inside the lookahead's open transaction, and the round's result is
        the lookahead's joined with the block's.
        """
        state = self.state
        if state.processors:
            phases.settle(rnd, state)  # processors read the block's history
        lazy = phases.is_lazy(rnd.block)
        if lazy:
            # Its ids are checked when read back (settle): until then the forward is fed
            # them clipped into the vocabulary, so no id can index outside the embedding.
            fed = mx.clip(rnd.block, 0, state.vocab_size - 1).astype(mx.int32)
        if on is not None:
            inputs = fed if lazy else mx.array(list(rnd.block))
        elif rnd.chosen is None:
            inputs = mx.array(state.history[-1:])
        elif lazy:
            inputs = mx.concatenate([mx.array(state.history[-1:]), fed])
        else:
            inputs = mx.array([state.history[-1], *rnd.block])
        rnd.n_fed = int(inputs.shape[0]) + (0 if on is None else 1)
        phases.choose_acceptor(self.pipe.policy, state.sampler, rnd)
        # An extended round's verify time counts from the queued forward's launch.
        rnd.t_launch = time.perf_counter() if on is None else on.t_launch
        rnd.txn = self.plan.begin() if on is None else on.txn
        try:
            vr = verify(self.pipe, inputs, state.caches)
            self.coord.built(vr.logits)
            rnd.vr = vr if on is None else _joined(on.vr, vr)
            project_row = vr.extras.get("project_row") if on is None else None
            if (
                project_row is not None
                and rnd.chosen is not None
                and rnd.acceptor == "greedy"
                and state.sampler.is_greedy
                and not state.processors
                and state.grammar is None
                and self.coord.local
            ):
                # The verifier projects rows on demand: queue the backbone only, and
                # project each position's logits until the first rejection.
                rnd.projected, rnd.rows = True, project_row
                rnd.logits = rnd.vr.logits  # left unevaluated
                self._launch(rnd.vr.hidden)
            else:
                rnd.logits = phases.process(
                    rnd.vr.logits, state.history, rnd.block, state.processors
                )
                if state.grammar is not None:
                    rnd.logits = state.grammar.apply(rnd.logits)
                self._launch(rnd.logits)
        except BaseException:
            rnd.txn.abort()
            self._undo_grammar()
            raise

    def _start_lookahead(self, rnd: Round) -> Round:
        """Queue the next round as a plain step on ``rnd``'s lazily sampled token, before
        that token is read back (``rnd`` drafted nothing: its transaction keeps all).

        The next round adopts it when the token it was fed is the one ``rnd`` commits:
        as it is when no drafter proposes, else with the block fed on top of it (see
        :meth:`_adopt`); otherwise it is aborted (its cache writes undone) and a normal
        round runs: the output never depends on it.
        """
        try:
            rnd.txn.commit(rnd.n_fed, rnd.n_fed)  # nothing drafted: keep the fed token
        except BaseException:
            rnd.txn.abort()
            raise
        rnd.committed = True
        y = self.state.sampler.sample_lazy(rnd.logits[-1:], rnd.position)
        rnd.next_sample = y
        # Evaluated on its own, as plain decoding does: reading the token back then does
        # not wait for the whole lookahead forward, whose tail overlaps the host's work.
        self._launch(y)
        la = Round(kind=RoundKind.LOOKAHEAD, position=rnd.position + 1, fed=y)
        la.acceptor = rnd.acceptor
        la.t_launch = time.perf_counter()
        la.txn = self.plan.begin()
        try:
            la.vr = verify(self.pipe, y.astype(mx.int32), self.state.caches)
            la.logits = la.vr.logits
            self._launch(la.logits)
        except BaseException:
            la.txn.abort()
            raise
        return la

    def _adopt(self, la: Round) -> Round:
        """The round after a lookahead: the lookahead itself when nobody drafts, else a
        round that feeds only the drafted block on top of it (the lookahead's forward
        already holds the last token and the logits that judge the first draft), in the
        lookahead's own transaction; the lookahead is aborted only when its position is
        not the round's or its result cannot be joined (verifier extras)."""
        state = self.state
        rnd = Round(kind=RoundKind.SPECULATIVE, position=len(state.history))
        try:
            self._plan(rnd)
        except BaseException:
            self._undo_lookahead(la)
            raise
        if la.position == rnd.position:
            if rnd.chosen is None:
                la.shadows = rnd.shadows
                state.stats.lookahead_rounds += 1
                return la
            if not set(la.vr.extras) - {"project_row"}:  # nothing that cannot be joined
                self._launch_round(rnd, on=la)
                state.stats.lookahead_extended += 1
                return rnd
        self._undo_lookahead(la)
        self._launch_round(rnd)
        return rnd

    def _undo_lookahead(self, la: Round) -> None:
        """Abort a round queued ahead: its cache writes are undone, its forward discarded."""
        la.txn.abort()
        self.state.stats.lookahead_aborts += 1

    def _launch(self, out: mx.array) -> None:
        """Queue the verify forward. The time is waiting time too: MLX lets only a few
        tasks be in flight, so on the CPU ``async_eval`` of a whole forward returns only
        when most of it has run."""
        t0 = time.perf_counter()
        mx.async_eval(out)
        self.state.stats.wait_time_s += time.perf_counter() - t0

    # -- finishing rounds ------------------------------------------------------------

    def _read(self, lazy: mx.array) -> int:
        """Read a lazily sampled token back (waiting time)."""
        t0 = time.perf_counter()
        tok = int(lazy.item())
        self.state.stats.wait_time_s += time.perf_counter() - t0
        return tok

    def _finish_round(self, rnd: Round) -> RoundResult:
        """Read the round back (the one host sync), accept, commit the caches."""
        state = self.state
        stats = state.stats
        if rnd.kind is RoundKind.PLAIN:
            tok = self._read(rnd.token)
            phases.commit_grammar(state, 0, tok)
            return phases.plain_result(rnd, tok, None)
        if rnd.next_sample is not None and not rnd.block and rnd.acceptor in _PLAIN_WHEN_EMPTY:
            # Nothing drafted: these acceptors draw the plain sample of the position, which
            # the lookahead already drew (lazily, with the same key): read it back.
            tok = self._read(rnd.next_sample)
            stats.acceptors[rnd.acceptor] = stats.acceptors.get(rnd.acceptor, 0) + 1
            return phases.plain_result(rnd, tok, rnd.vr)
        try:
            t0 = time.perf_counter()
            phases.settle(rnd, state)
            if rnd.projected:
                acc = phases.checked(rnd, phases.accept_rows(stats, rnd), state)
            else:
                acc = phases.accept(self.pipe.acceptors, rnd, state.sampler, state)
            phases.check_q(state, rnd, acc.n_accepted)
            phases.commit_grammar(state, acc.n_accepted, acc.token)
            t_commit = time.perf_counter()
            stats.wait_time_s += t_commit - t0
            # Lazy: the next forward evaluates what the rollback built (no second sync).
            if not rnd.committed:
                try:
                    rnd.txn.commit(rnd.n_fed, acc.n_accepted + 1)
                except Exception as exc:
                    rollbacks = "+".join(stats.rollbacks)
                    guard.blame(state, "cache_rollback", rollbacks, "commit", exc, rnd.position)
        except BaseException:
            if not rnd.committed:
                rnd.txn.abort()
            self._undo_grammar()
            raise
        t_done = time.perf_counter()
        if rnd.block:  # a round with nothing drafted has nothing to roll back
            stats.verify_time_s += t_commit - rnd.t_launch
            stats.commit_time_s += t_done - t_commit
        return phases.result(state, rnd, acc.n_accepted, acc.token)


class _RoundClock:
    """Tells the cost model each round's wall time and kind (see ``RoundOverhead``).

    ``drafted``: the round verified a block (of ``rnd.chosen``). ``after_draft``: one of
    the plain steps after a drafted round (``since`` rounds ago, of ``drafter``'s) until
    steps are queued ahead again: the few the loop runs unpipelined, and the first one
    queued ahead, whose forward was mostly run while the round before it queued it, so
    the two together cost what they cost. ``plain``: a step queued ahead otherwise.
    Unpipelined plain steps that no draft caused (the first rounds of a request, its
    last two, rows with logits processors) teach nothing. A round's time runs from the
    end of the round before (the first one's from the end of the prefill), less the
    time the stream sat suspended at its yields (its consumer's work).
    """

    def __init__(self, cost: Any, state: RequestState):
        self.cost, self.state = cost, state
        self.t_prev, self.away_prev = state.t_start, state.away_s
        self.drafter: str | None = None  # who drafted the last drafted round
        self.since = 0  # rounds since it

    def tick(self, rnd: Round, can_queue: bool) -> None:
        if self.cost is None:
            return
        t_now = time.perf_counter()
        seconds = t_now - self.t_prev - (self.state.away_s - self.away_prev)
        self.t_prev, self.away_prev = t_now, self.state.away_s
        if rnd.chosen is not None:
            self.drafter, self.since = rnd.chosen, 0
            self.cost.observe_round("drafted", rnd.n_fed, rnd.position, seconds, rnd.chosen)
            return
        self.since += 1
        queued = rnd.kind is RoundKind.LOOKAHEAD
        recent = self.drafter is not None and self.since <= IDLE_LOOKAHEAD + 2
        if recent and (queued or can_queue):
            self.cost.observe_round("after_draft", 1, rnd.position, seconds, self.drafter)
        elif queued:
            self.cost.observe_round("plain", 1, rnd.position, seconds)
