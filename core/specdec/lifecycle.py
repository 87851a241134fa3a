"""A request's life outside its rounds: its state, opening it (rollback plan, sessions,
cost curve), prefilling its prompt, completing its stats, closing it.

Both drivers (:mod:`specdec.single`, :mod:`specdec.batch`) use these functions on
the components of a :class:`specdec.Pipeline` (read through its public attributes).
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from . import guard
from .attention import verify_attention
from .emit import Emitter
from .errors import RequestError, SpecdecError
from .grammar import FORCED
from .request import Request
from .roles import PrefillChunk, RequestContext, VerifyResult, optional
from .rollback import RollbackPlan, build_plan
from .sampling import Sampler
from .stats import Stats

__all__ = [
    "RequestState",
    "close",
    "finish_stats",
    "new_state",
    "open_request",
    "prefill",
    "prompt_cache_length",
]


@attrs.define
class RequestState:
    """One request's decode state (one row of a batch).

    Attributes:
        request: its arguments.
        history: prompt and committed tokens.
        sampler: its position-keyed sampler (on a sharded model, with rank 0's seed).
        caches: the target's caches (a batch's rows share the batch's).
        stats: its statistics.
        processors: its logits processors.
        stop_ids: the token ids that end it.
        emitter: its output side (made by :func:`open_request`).
        sessions: ``[(drafter name, session)]`` in policy order (empty: plain decoding).
        governor: the governor's session, or ``None``.
        governor_name: the governor's name in the policy.
        cost: the cost model in use, or ``None``.
        row: its id in a batch (0 alone).
        t_start: when decoding started.
        away_s: seconds the stream spent suspended at its yields (its consumer's time),
            left out of the round times the cost model learns from.
        prefill_forwards: prefill forwards run.
        cached: prompt tokens the caches held when the request began (a ``prompt_cache``):
            the prefill feeds only the ones after them.
        history_array: the history as an ``mx.array`` (kept only while processors need it).
        host: the plugin host (names components in errors).
        heads: the draft heads by drafter name.
        vocab_size: the target's vocabulary size (draft ids are checked against it).
        grammar: the request's grammar matcher (:class:`specdec.grammar.GrammarState`),
            or ``None``.
        forces: the request drafts its grammar's forced tokens (a constrained request
            under a policy that :attr:`specdec.Policy.forces`).
    """

    request: Request
    history: list
    sampler: Sampler
    caches: list
    stats: Stats
    processors: list
    stop_ids: frozenset
    emitter: Any = None
    sessions: list = attrs.field(factory=list)
    governor: Any = None
    governor_name: str | None = None
    cost: Any = None
    row: int = 0
    t_start: float = 0.0
    away_s: float = 0.0
    prefill_forwards: int = 0
    cached: int = 0
    history_array: Any = None
    host: Any = None
    heads: dict = attrs.field(factory=dict)
    vocab_size: int = 0
    grammar: Any = None
    forces: bool = False


def new_state(
    pipe: Any, request: Request, ids: list[int], prompt_cache: list | None = None
) -> RequestState:
    """A request's state: its sampler and processors built, fresh caches (or
    ``prompt_cache``, checked with :func:`prompt_cache_length`, used in place); no
    session yet.

    Raises:
        RequestError: ``prompt_cache`` is not the model's caches or holds too much.
    """
    cached = 0 if prompt_cache is None else prompt_cache_length(pipe.model, prompt_cache, len(ids))
    stats = Stats(policy=pipe.policy.name, prompt_tokens=len(ids), verifier=pipe.verifier.name)
    stats.cached_tokens = cached
    grammar = pipe.grammar_state(request)
    return RequestState(
        request=request,
        history=ids,
        sampler=request.sampler(),
        caches=make_prompt_cache(pipe.model) if prompt_cache is None else prompt_cache,
        cached=cached,
        stats=stats,
        processors=request.processors(),
        stop_ids=request.stop_ids(pipe.tokenizer),
        host=pipe.host,
        heads=pipe.heads,
        vocab_size=pipe.vocab_size,
        grammar=grammar,
        forces=grammar is not None and pipe.policy.forces,
    )


def prompt_cache_length(model: Any, caches: Any, prompt_len: int) -> int:
    """How many tokens ``caches`` (a ``prompt_cache``: the model's per-layer caches,
    ``mlx_lm.models.cache.make_prompt_cache(model)``, after earlier requests) hold: the
    prompt's first tokens, of which it must hold at most all but the last.

    Raises:
        RequestError: not a list of the model's per-layer caches (layer count and types),
            layers that hold different lengths, no layer that tells its length, or as
            many tokens as the prompt has or more.
    """
    want = make_prompt_cache(model)
    if not isinstance(caches, (list, tuple)) or len(caches) != len(want):
        raise RequestError(
            f"prompt_cache must be a list of the model's {len(want)} per-layer caches "
            "(mlx_lm.models.cache.make_prompt_cache(model)), got "
            f"{type(caches).__name__}"
            + (f" of {len(caches)}" if isinstance(caches, (list, tuple)) else "")
        )
    lengths = set()
    for i, (c, w) in enumerate(zip(caches, want)):
        if type(c) is not type(w):
            raise RequestError(
                f"prompt_cache layer {i} is a {type(c).__name__}; the model's is a "
                f"{type(w).__name__} (a cache of another model?)"
            )
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            lengths.add(offset)
    if len(lengths) != 1:
        raise RequestError(
            f"prompt_cache layers hold different numbers of tokens: {sorted(lengths)}"
            if lengths
            else "prompt_cache has no layer that tells how many tokens it holds"
        )
    n = lengths.pop()
    if n > prompt_len - 1:
        raise RequestError(
            f"prompt_cache holds {n} tokens; the prompt has {prompt_len}: the cache must "
            "hold the prompt's first tokens, at most all but the last (give the whole "
            "conversation as the prompt, the cache holding what an earlier request fed)"
        )
    return n


def open_request(
    pipe: Any,
    state: RequestState,
    *,
    off_reason: str | None = None,
    row: int = 0,
    reset_peak: bool = True,
    on_end: Any = None,
) -> RollbackPlan:
    """Open a request: its rollback plan, emitter, cost curve and the drafter and governor
    sessions (none when speculation is off for it: the policy has no drafters, a cache
    cannot be rolled back, or ``off_reason`` says why not). Call :func:`close` after it,
    also when it raised. ``on_end(reason)`` completes the stats when the stream ends
    (default :func:`finish_stats`)."""
    policy, stats = pipe.policy, state.stats
    state.row = row
    plan = build_plan(pipe.host, state.caches, model=pipe.model, policy=policy)
    stats.rollbacks = plan.names()
    drafters = list(pipe.drafters)
    if not drafters:
        stats.speculation_off_reason = f"policy {policy.name!r} has no drafters"
    elif not plan.ok:
        stats.speculation_off_reason = plan.reason
        drafters = []
    elif off_reason is not None:
        stats.speculation_off_reason = off_reason
        drafters = []
    if off_reason is not None:
        # a batch that cannot roll rows back apart: every row keeps what it was fed,
        # so no row may feed a block (a grammar's forced tokens included)
        state.forces = False
    end = on_end or (lambda reason: finish_stats(pipe, state))
    state.emitter = Emitter(
        pipe.tokenizer, state.stop_ids, state.request.stop, state.request.max_tokens, stats, end
    )
    state.cost = _cost(pipe.cost_model if drafters else None, stats)
    if reset_peak:  # a row joining a running batch keeps the others' peak
        mx.reset_peak_memory()
    common: dict[str, Any] = dict(
        model=pipe.model,
        tokenizer=pipe.tokenizer,
        prompt_tokens=list(state.history),
        max_tokens=state.request.max_tokens,
        sampler=state.sampler,
        caches=state.caches,
        host=pipe.host,
        verifier=pipe.verifier,
        plan=plan,
        row=row,
        cached=state.cached,
    )
    if state.cost is not None:
        common["cost"] = state.cost
    for d in drafters:
        ctx = RequestContext(
            **common, options=policy.options_for(d.name), head=pipe.heads.get(d.name)
        )
        try:
            session = d.session(ctx)
        except Exception as exc:
            guard.blame(state, "drafter", d.name, "session", exc, None)
        state.sessions.append((d.name, session))
        stats.per_drafter[d.name] = {"rounds": 0, "drafted": 0, "accepted": 0}
    if state.grammar is not None:
        stats.grammar = {"kind": state.grammar.grammar.kind, "forced": 0, "cut": 0}
        if state.forces:
            stats.per_drafter[FORCED] = {"rounds": 0, "drafted": 0, "accepted": 0}
    if pipe.governor is not None and drafters:
        ctx = RequestContext(**common, options=policy.options_for(policy.governor))
        state.governor_name = policy.governor
        try:
            state.governor = pipe.governor.session(ctx)
        except Exception as exc:
            guard.blame(state, "governor", policy.governor, "session", exc, None)
    return plan


def _cost(cost: Any, stats: Stats) -> Any:
    """The cost model a request's drafters get, its curve loaded (or ``None``).

    Loads (or profiles) the curve, a longer context too when requests ran past twice the
    longest profiled one; before the peak memory is reset, so that profiling is not
    counted as the request's memory. A curve that cannot be measured does not fail the
    request: drafters get no ``ctx.cost`` (ngram_copy then sizes by its ladder and says
    so) and ``stats.verify_cost`` has the error.
    """
    if cost is None:
        return None
    try:
        cost.refresh()
    except Exception as exc:  # noqa: BLE001 - reported in stats, never silent
        cost.failure = f"{type(exc).__name__}: {exc}"
    stats.verify_cost = cost.stats()
    return cost if cost.loaded else None


def close(state: RequestState) -> None:
    """End a request's sessions (errors while ending never mask the request's own)."""
    if state.cost is not None:
        state.cost.note_context(len(state.history))
        state.cost = None
    for _, s in state.sessions:
        try:
            s.end()
        except Exception:  # ending must not mask the real error
            pass
    state.sessions = []
    gov, state.governor = state.governor, None
    if gov is not None:
        try:
            gov.end()
        except Exception:
            pass


def verify(pipe: Any, tokens: mx.array, caches: list) -> VerifyResult:
    """The verifier's forward over ``tokens``, with the CPU's verify attention
    (:mod:`specdec.attention`: MLX's own result, bit for bit, in less time)."""
    with verify_attention():
        try:
            return pipe.verifier.verify(pipe.model, tokens, caches)
        except Exception as exc:
            if isinstance(exc, SpecdecError):
                raise
            raise guard.named_error(
                pipe.host, "verifier", pipe.verifier.name, "verify", exc
            ) from exc


def prefill(pipe: Any, state: RequestState, coord: Any) -> None:
    """Feed the prompt but its last token through the verifier, in chunks of the request's
    ``prefill_step_size``; sessions with a ``prefill`` method see every chunk's result
    (hidden states too). ``coord`` (the request's coordinator) decides what a failed
    chunk means: one process raises at once; a rank keeps feeding (the other ranks'
    collectives pair up with its forwards) and raises at the end."""
    t0 = time.perf_counter()
    prompt, caches, step = state.history, state.caches, state.request.prefill_step_size
    listeners = [
        (name, fn)
        for name, s in state.sessions
        if callable(fn := optional(s, "drafter_session", "prefill"))
    ]
    failed: BaseException | None = None
    for start in range(state.cached, len(prompt) - 1, step):
        chunk = prompt[start : min(start + step, len(prompt) - 1)]
        state.prefill_forwards += 1
        if failed is not None:
            coord.rerun(chunk)
            continue
        vr = None
        try:
            vr = verify(pipe, mx.array(chunk), caches)
            if listeners:
                record = PrefillChunk(tokens=tuple(chunk), start_position=start, result=vr)
                for name, listen in listeners:
                    try:
                        listen(record)
                    except Exception as exc:
                        guard.blame(state, "drafter", name, "prefill", exc, None)
            # The chunk's logits are never read: only the caches are evaluated.
            mx.eval([c.state for c in caches])
        except Exception as exc:
            coord.prefill_failed(exc, None if vr is None else vr.logits, chunk)
            failed = exc
    if failed is not None:
        raise failed
    state.stats.prompt_time_s = time.perf_counter() - t0


def finish_stats(pipe: Any, state: RequestState, coord: Any = None) -> None:
    """Complete a request's stats when its stream ends: times, memory, the governor's,
    the cost model's, the draft heads' and the sessions' own statistics."""
    stats = state.stats
    stats.decode_time_s = time.perf_counter() - state.t_start
    stats.peak_memory_gb = mx.get_peak_memory() / 1e9
    if coord is not None:
        dist = coord.stats(state)
        if dist is not None:
            stats.distributed = dist
    if state.governor is not None:
        stats.governor = dict(state.governor.stats())
    if state.cost is not None:
        stats.verify_cost = state.cost.stats()  # with the round overhead learnt
    if state.grammar is not None:
        stats.grammar["mask_time_s"] = state.grammar.time_s
    shown: dict[str, Any] = {}  # key -> head object
    for drafter, head in pipe.heads.items():
        extra = optional(head, "draft_head", "stats")
        if not callable(extra):
            continue
        key = head.name
        if shown.get(key, head) is not head:  # another head of that name (another model)
            key = f"{head.name} ({drafter})"
        if key not in shown:
            shown[key] = head
            stats.draft_heads[key] = dict(extra())
    for name, s in state.sessions:
        extra = optional(s, "drafter_session", "stats")
        if callable(extra) and name in stats.per_drafter:
            stats.per_drafter[name].update(extra())
