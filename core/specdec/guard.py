"""Holding a request's components to their contract.

Every draft is checked before it reaches the model (:func:`check_draft`,
:func:`check_ids`, :func:`check_q`) and every exception a component raises during a
request reaches the caller as a :class:`specdec.ComponentError` that names the
component, its distribution and version, the round and the call (:func:`blame`);
the exception is its ``__cause__``.

What the checks cost on the hot path:

- a block of ints: ``min`` / ``max`` over at most ``max_block`` ints on the host;
- a lazy ``mx.array`` block: its shape and dtype only (no host sync) before the
  forward, which is fed the ids clipped into the vocabulary (one elementwise op in the
  graph, so an out-of-range id can never index the embedding); the ids themselves are
  checked when the round reads the block back (:func:`specdec.round.settle`), the one
  host sync it has anyway, before anything is accepted;
- ``q``: its shape before the forward; after the acceptor, before the commit, the values
  acceptance read (:func:`check_q`): ``k`` gathered values and, on a round with a
  rejection, one row.

Errors a component raises on purpose (:class:`specdec.SpecdecError`) pass unchanged.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import mlx.core as mx

from .errors import ComponentError, DraftError, SpecdecError

__all__ = [
    "blame",
    "check_draft",
    "check_ids",
    "check_q",
    "component_error",
    "describe",
    "named_error",
]


def describe(host: Any, role: str, name: str | None) -> str:
    """``"drafter 'ngram_copy' (specdec-plugin-ngram 0.4.0)"``: a component as errors
    name it (its distribution and version when the host knows them)."""
    label = f"{role.replace('_', ' ')} {name!r}"
    info = host.components.get(role, {}).get(name) if name is not None else None
    if info is not None:
        label += f" ({info.distribution} {info.version})"
    return label


def _where(state: Any, position: int | None) -> tuple[int, str]:
    if position is None:
        return 0, "while opening the request"
    n = state.stats.target_forwards + 1
    return n, f"in round {n} (position {position})"


def _label(state: Any, role: str, name: str | None) -> str:
    label = describe(state.host, role, name)
    head = state.heads.get(name) if role == "drafter" and state.heads else None
    if head is not None:
        label += f" with {describe(state.host, 'draft_head', head.name)}"
    return label


def _dist(host: Any, role: str, name: str | None) -> str:
    info = host.components.get(role, {}).get(name)
    return "" if info is None else f"{info.distribution} {info.version}"


def named_error(
    host: Any,
    role: str,
    name: str | None,
    call: str,
    exc: BaseException,
    *,
    label: str | None = None,
    where: str = "",
    round: int = 0,
    position: int | None = None,
) -> ComponentError:
    """The :class:`specdec.ComponentError` for ``exc`` raised by ``name``'s ``call``:
    ``"<label> raised in <call>() <where>: <type>: <message>"`` (``label`` defaults to
    :func:`describe`'s)."""
    return ComponentError(
        f"{label or describe(host, role, name)} raised in {call}()"
        f"{' ' + where if where else ''}: {type(exc).__name__}: {exc}",
        role=role,
        component=name or "",
        distribution=_dist(host, role, name),
        round=round,
        position=position,
        call=call,
    )


def component_error(
    state: Any, role: str, name: str | None, call: str, exc: BaseException, position: int | None
) -> ComponentError:
    """:func:`named_error` for a request's component: the round and the position named,
    a drafter's draft head too."""
    n, where = _where(state, position)
    return named_error(
        state.host,
        role,
        name,
        call,
        exc,
        label=_label(state, role, name),
        where=where,
        round=n,
        position=position,
    )


def blame(
    state: Any, role: str, name: str | None, call: str, exc: BaseException, position: int | None
) -> NoReturn:
    """Raise, for ``exc`` raised by ``name``'s ``call`` (call it in the ``except`` clause):
    ``exc`` itself when it is a specdec error already (raised on purpose, or named by an
    inner call), else :func:`component_error` with ``exc`` as its cause."""
    if isinstance(exc, SpecdecError):
        raise exc
    raise component_error(state, role, name, call, exc, position) from exc


def _bad_draft(state: Any, name: str, position: int, what: str) -> DraftError:
    n, where = _where(state, position)
    return DraftError(
        f"{_label(state, 'drafter', name)} proposed a bad draft {where}: {what}",
        role="drafter",
        component=name,
        distribution=_dist(state.host, "drafter", name),
        round=n,
        position=position,
        call="propose",
    )


def check_ids(state: Any, name: str, block: tuple, position: int) -> None:
    """Every id of a block of ints is in ``[0, vocab_size)``.

    Raises:
        DraftError: naming the first id outside it.
    """
    v = state.vocab_size
    if block and (min(block) < 0 or max(block) >= v):
        i, t = next((i, t) for i, t in enumerate(block) if not 0 <= t < v)
        raise _bad_draft(
            state,
            name,
            position,
            f"token id {t} at index {i} of {list(block)[:16]} is outside the vocabulary [0, {v})",
        )


def check_draft(state: Any, name: str, draft: Any, budget: int, position: int) -> None:
    """A draft as proposed: no longer than ``budget``; its ids in the vocabulary (a lazy
    array: 1-D of an integer type, its values checked when read back); ``acceptance``
    one float in ``[0, 1]`` per token; ``q`` of shape ``[len(tokens), vocab_size]``.

    Raises:
        DraftError: naming what was wrong.
    """
    toks = draft.tokens
    if isinstance(toks, tuple):
        k = len(toks)
    else:
        if toks.ndim != 1 or not mx.issubdtype(toks.dtype, mx.integer):
            raise _bad_draft(
                state,
                name,
                position,
                f"tokens must be a 1-D array of integer ids, got shape {tuple(toks.shape)} "
                f"of {toks.dtype}",
            )
        k = int(toks.shape[0])
    if k > budget:
        raise _bad_draft(
            state,
            name,
            position,
            f"{k} tokens where at most {budget} were asked for (propose's max_len)",
        )
    if isinstance(toks, tuple):
        check_ids(state, name, toks, position)
    est = draft.acceptance
    if est is not None and (
        len(est) != k or not all(math.isfinite(a) and 0.0 <= a <= 1.0 for a in est)
    ):
        raise _bad_draft(
            state,
            name,
            position,
            f"acceptance must be {k} floats in [0, 1] (one per drafted token), got "
            f"{list(est)[:8]}{' ...' if len(est) > 8 else ''} ({len(est)})",
        )
    q = draft.probs
    if q is not None:
        shape = tuple(q.shape) if isinstance(q, mx.array) else None
        if shape != (k, state.vocab_size):
            raise _bad_draft(
                state,
                name,
                position,
                f"probs (q) must have shape ({k}, {state.vocab_size}) = (block length, "
                f"vocabulary size), got {shape or type(q).__name__}",
            )


def check_q(state: Any, name: str, block: tuple, q: Any, n_accepted: int, position: int) -> None:
    """The values of ``q`` that acceptance read: at each drafted token up to the first
    rejected one, finite and above 0 (a token ``q`` gives probability 0 cannot have been
    drawn from it); and the whole row of the first rejected position, from which the
    correction is drawn (``max(p - q, 0)``), finite and non-negative. Called after the
    acceptor, before the round is committed: a bad ``q`` then ends the request with
    nothing of the round kept. Rows after the first rejection are never read.

    Costs a gather of at most ``k`` values and, on a round with a rejection, one pass
    over one row: not one over the whole ``[k, vocab]``.

    Raises:
        DraftError: naming the row and what was wrong.
    """
    k = len(block)
    used = min(n_accepted + 1, k)  # rows whose drafted token was judged
    at = mx.take_along_axis(q[:used], mx.array(block[:used])[:, None], axis=-1)[:, 0]
    checks = [mx.min(at)]
    if n_accepted < k:  # the residual row of the first rejected position
        row = q[n_accepted]
        checks += [mx.min(row), mx.sum(row)]
    vals = mx.stack([c.astype(mx.float32) for c in checks]).tolist()
    if (
        math.isfinite(vals[0])
        and vals[0] > 0
        and (len(vals) == 1 or (vals[1] >= 0 and math.isfinite(vals[2])))
    ):
        return
    what = _q_problem(block, at, vals, n_accepted)
    raise _bad_draft(state, name, position, f"probs (q) {what}")


def _q_problem(block: tuple, at: Any, vals: list, n_accepted: int) -> str:
    """In words, what :func:`check_q` found wrong (off the hot path)."""
    at_l = at.tolist()
    for i, v in enumerate(at_l):
        if not math.isfinite(v):
            return f"row {i} is not finite at the drafted token {block[i]} ({v})"
        if v <= 0:
            return f"row {i} gives the drafted token {block[i]} probability {v:.3g}"
    j = n_accepted
    if not math.isfinite(vals[2]):
        return f"row {j} (the first rejected position) is not finite (NaN or infinity)"
    return f"row {j} (the first rejected position) has a negative probability ({vals[1]:.3g})"
