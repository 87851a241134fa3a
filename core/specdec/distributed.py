"""Speculation on a model sharded across processes with ``mx.distributed``.

A model too big for one machine runs as N ranks (``mlx.launch``, ring or MPI
backends), each holding a shard (tensor parallel: every decoder layer's
projections split across the ranks, an ``all_sum`` after the attention and
after the MLP). Every forward then pays the collectives of every layer; a
speculative round verifies a whole block in one forward, so it pays them once
for up to ``k + 1`` tokens.

Every rank runs the same pipeline on the same request, and must take the same
decisions: the same block each round, the same accepted prefix, the same
sampled tokens, the same stop. :class:`RankSync` makes that so and checks it:

- **Once per request** (before prefill): the ranks compare the request (prompt,
  limits) and take rank 0's sampling seed, so position-keyed sampling draws the
  same tokens everywhere.
- **Once per round** (before the verify forward): one small ``all_gather`` of a
  fixed-size int32 record per rank: its status, how many tokens it committed and
  a hash of them, and the block it would verify. A rank whose committed tokens
  differ from rank 0's fails the request loudly on every rank
  (:class:`DistributedError`: "ranks diverged"). The block verified is rank 0's
  (a drafter whose block sizes depend on local timings may propose another on
  another rank); its draft probabilities, when it has them, are broadcast from
  rank 0 unless every rank proposed the same block with a drafter that declares
  ``deterministic = True``.
- **Once at the end**: the final history is compared, and a rank that failed in
  the last round is heard of.

A failure on one rank (an exception in a round) is not a hang: the failing rank
first completes the forward the others are running (so the collectives stay
paired), then joins the next synchronisation point with its error; every rank
then ends the request, the failing one with its own exception and the others
with a :class:`DistributedError` that names the rank, the round and the error.
A rank that dies outright closes its sockets, and the backend's collectives then
raise on the other ranks (``[ring] connection to a peer was lost``).

Plain decoding on a sharded model runs the same loop (a round is a plain step),
without the queued-ahead forward of single-process decoding: a queued forward's
collectives could not be paired with a failing rank's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .coordinate import Coordinator
from .errors import DistributedError, ModelLoadError
from .roles import optional
from .round import settle

__all__ = [
    "DistributedError",
    "RankCoordinator",
    "RankSync",
    "SHARDING_KINDS",
    "Sharding",
    "adopt_sharding",
    "collectives_per_forward",
    "launched_world",
    "looks_sharded",
    "model_sharding",
    "shard_model",
]

#: Environment variables a distributed launcher sets (mlx.launch's ring and MPI
#: backends, mpirun, jaccl); without one, this process is not one of several ranks.
LAUNCH_ENV = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MLX_JACCL_COORDINATOR")

_SHARDING_ATTR = "_specdec_sharding"


def launched_world() -> Any:
    """The ``mx.distributed`` group of all ranks when this process was started as one of
    several (by ``mlx.launch`` or ``mpirun``), else ``None``."""
    if not any(os.environ.get(k) for k in LAUNCH_ENV):
        return None
    if not mx.distributed.is_available():
        raise DistributedError(
            "this process was launched as a rank of a distributed job "
            f"({', '.join(k for k in LAUNCH_ENV if os.environ.get(k))} is set) but this MLX "
            "build has no distributed backend"
        )
    group = mx.distributed.init()
    return group if group.size() > 1 else None


@attrs.frozen
class Sharding:
    """How a model is split across the ranks of ``group``.

    Attributes:
        group: the ``mx.distributed`` group.
        kind: ``"tensor"``: every decoder layer's projections split across the ranks;
            ``"pipeline"``: the decoder layers split across the ranks (rank ``n - 1``
            runs the first ones and sends its hidden states on, rank 0 the last ones,
            whose output every rank gathers).
        method: ``"mlx-lm"`` (the model's own ``shard(group)`` or ``pipeline(group)``),
            ``"uneven-heads"`` (specdec's split of a llama-style layer whose heads do not
            divide evenly: whole key/value head groups per rank, as even as they go) or
            ``"given"`` (a model sharded elsewhere).
        collectives_per_forward: collective operations one forward issues on this rank.
        heads: ``[(query heads, key/value heads)]`` per rank (tensor parallel).
        layers: ``(first, end)`` decoder layers this rank runs (pipeline parallel).
    """

    group: Any
    kind: str
    method: str
    collectives_per_forward: int
    heads: tuple = ()
    layers: tuple = ()

    @property
    def ranks(self) -> int:
        """How many ranks share the model."""
        return self.group.size()

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.group.rank()

    def to_dict(self) -> dict:
        """A JSON-able description."""
        return {
            "ranks": self.ranks,
            "rank": self.rank,
            "kind": self.kind,
            "method": self.method,
            "collectives_per_forward": self.collectives_per_forward,
            "heads": [list(h) for h in self.heads],
            "layers": list(self.layers),
        }


def model_sharding(model: Any) -> Sharding | None:
    """The :class:`Sharding` :func:`shard_model` applied to ``model``, or ``None``."""
    v = getattr(model, "__dict__", {}).get(_SHARDING_ATTR)
    return v if isinstance(v, Sharding) else None


# -- collectives -------------------------------------------------------------------


class ColumnShard(nn.Module):
    """Rows ``[start, stop)`` of a linear layer's output on this rank: no collective
    (the input is the whole activation, the output this rank's share of it)."""

    def __init__(self, linear: Any, start: int, stop: int):
        super().__init__()
        self.weight = linear.weight[start:stop]
        if "bias" in linear:
            self.bias = linear.bias[start:stop]

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return mx.addmm(self["bias"], x, self["weight"].T)
        return x @ self["weight"].T


class RowShard(nn.Module):
    """Input columns ``[start, stop)`` of a linear layer on this rank, then one
    ``all_sum`` over the group: every rank gets the whole output."""

    def __init__(self, linear: Any, start: int, stop: int, group: Any):
        super().__init__()
        self.weight = linear.weight[:, start:stop]
        if "bias" in linear:
            self.bias = linear.bias
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        x = mx.distributed.all_sum(x @ self["weight"].T, group=self.group)
        if "bias" in self:
            x = x + self["bias"]
        return x


#: Module classes that issue one collective per call.
_COLLECTIVE_CLASSES = ("ShardedToAllLinear", "QuantizedShardedToAllLinear", "RowShard")


def collectives_per_forward(model: Any) -> int:
    """How many collective operations one forward of ``model`` issues on this rank: its
    ``sharded-to-all`` layers (one ``all_sum`` each) and mlx-lm's sharded mixture-of-
    experts blocks (a ``sharding_group`` set by ``shard()``: one ``all_sum`` each); 0 for
    an object that is no ``mlx.nn.Module`` (a test's stand-in)."""
    named = getattr(model, "named_modules", None)
    if not callable(named):
        return 0
    return sum(
        1
        for _, m in named()
        if type(m).__name__ in _COLLECTIVE_CLASSES
        or getattr(m, "__dict__", {}).get("sharding_group") is not None
    )


def looks_sharded(model: Any) -> bool:
    """Whether ``model`` was split across ranks (sharded layers, or mlx-lm's
    ``pipeline(group)`` applied), by whatever means."""
    inner = getattr(model, "model", None)
    return getattr(inner, "pipeline_size", 1) > 1 or collectives_per_forward(model) > 0


def adopt_sharding(model: Any, group: Any) -> Sharding:
    """Record that ``model`` was sharded across ``group`` elsewhere (mlx-lm's
    ``sharded_load``, the model's own ``shard``), so a pipeline keeps its ranks in step.

    Raises:
        ModelLoadError: the model has no collective in its forward (it is not sharded).
    """
    inner = getattr(model, "model", None)
    if getattr(inner, "pipeline_size", 1) > 1:  # mlx-lm's pipeline(group) was applied
        return _pipeline_sharding(model, group, "given")
    n = collectives_per_forward(model)
    if n == 0:
        raise ModelLoadError(
            f"{type(model).__name__} issues no collective in its forward: it is not sharded "
            "(shard it with specdec.distributed.shard_model or mlx-lm's sharded_load)"
        )
    return _recorded(
        model, Sharding(group=group, kind="tensor", method="given", collectives_per_forward=n)
    )


def _recorded(model: Any, info: Sharding) -> Sharding:
    """Record ``info`` on ``model`` (what :func:`model_sharding` returns); return it."""
    object.__setattr__(model, _SHARDING_ATTR, info)
    return info


def _pipeline_sharding(model: Any, group: Any, method: str) -> Sharding:
    """The :class:`Sharding` of a model mlx-lm's ``pipeline(group)`` was applied to,
    recorded on it."""
    inner = model.model
    n, rank = inner.pipeline_size, inner.pipeline_rank
    # a forward: recv from the rank before (all but the last rank), send to the next
    # (all but rank 0), then every rank gathers rank 0's output
    ops = (1 if rank < n - 1 else 0) + (1 if rank > 0 else 0) + 1
    return _recorded(
        model,
        Sharding(
            group=group,
            kind="pipeline",
            method=method,
            collectives_per_forward=ops,
            layers=(int(inner.start_idx), int(inner.end_idx)),
        ),
    )


def _split(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous groups as even as they go (first ones larger)."""
    base, extra = divmod(n, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def _layers(model: Any) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers or [])


def _heads(attn: Any) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head dim)`` of a llama-style attention module."""
    n_heads = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    if not n_heads or not n_kv:
        raise ModelLoadError(
            f"cannot read the head counts of attention module {type(attn).__name__} "
            "(expected n_heads and n_kv_heads attributes, as mlx-lm's llama/qwen/mistral have)"
        )
    head_dim = attn.q_proj.weight.shape[0] // n_heads
    return int(n_heads), int(n_kv), int(head_dim)


#: What :func:`shard_model` accepts as ``kind``.
SHARDING_KINDS = ("auto", "tensor", "pipeline")


def _can_pipeline(model: Any) -> bool:
    return callable(getattr(getattr(model, "model", None), "pipeline", None))


def shard_model(model: Any, group: Any, kind: str = "auto") -> Sharding:
    """Split ``model`` across the ranks of ``group``, in place.

    ``kind="tensor"``: uses the model's own ``shard(group)`` (mlx-lm's) when its
    attention heads divide evenly across the ranks. Otherwise, for llama-style layers
    (``self_attn.q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj`` and
    ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``, dense weights), each rank takes
    whole groups of query heads with their key/value head (as even as they go: 3
    key/value heads on 2 ranks are 2 and 1) and an even slice of the MLP. Embeddings
    and the output layer stay whole on every rank.

    ``kind="pipeline"``: the model's own ``pipeline(group)`` (mlx-lm's, for the models
    that have one, e.g. qwen2, qwen3_next, qwen3_5, deepseek): each rank keeps a
    contiguous run of decoder layers; a forward passes the hidden states from rank
    to rank (``send``/``recv``) and gathers the last rank's output on every rank.

    ``kind="auto"`` (as mlx-lm's ``sharded_load``): tensor parallel when the model has
    a ``shard`` or llama-style layers, else pipeline parallel.

    Raises:
        ModelLoadError: the model cannot be split this way across this many ranks
            (with why), or ``kind`` is unknown.
    """
    if kind not in SHARDING_KINDS:
        raise ModelLoadError(
            f"unknown sharding {kind!r}: expected one of {', '.join(SHARDING_KINDS)}"
        )
    if model_sharding(model) is not None:
        raise ModelLoadError(
            "the model is sharded already (specdec.distributed.model_sharding(model) says how)"
        )
    n = group.size()
    layers = _layers(model)
    if not layers:
        raise ModelLoadError(
            f"cannot shard {type(model).__name__}: it has no decoder layers (model.layers)"
        )
    attn = getattr(layers[0], "self_attn", None)
    try:
        heads = _heads(attn) if attn is not None and hasattr(attn, "q_proj") else None
    except ModelLoadError:  # another attention layout: only the model's own shard() applies
        heads = None
    own_shard = callable(getattr(model, "shard", None))
    if kind == "auto":
        kind = (
            "tensor" if own_shard or heads is not None or not _can_pipeline(model) else "pipeline"
        )
    if kind == "pipeline":
        return _shard_pipeline(model, group, len(layers))
    even = heads is not None and heads[0] % n == 0 and heads[1] % n == 0
    if own_shard and (even or heads is None):
        model.shard(group)
        method = "mlx-lm"
        per = [(heads[0] // n, heads[1] // n)] * n if heads else []
    else:
        per = _shard_uneven(model, layers, group, heads)
        method = "uneven-heads"
    mx.eval(model.parameters())
    info = Sharding(
        group=group,
        kind="tensor",
        method=method,
        collectives_per_forward=collectives_per_forward(model),
        heads=tuple(per),
    )
    if info.collectives_per_forward == 0:
        raise ModelLoadError(
            f"sharding {type(model).__name__} across {n} ranks left no collective in its "
            "forward: the model was not split (its shard() did nothing)"
        )
    return _recorded(model, info)


def _shard_pipeline(model: Any, group: Any, n_layers: int) -> Sharding:
    n = group.size()
    if not _can_pipeline(model):
        raise ModelLoadError(
            f"cannot split {type(model).__name__} into a pipeline: mlx-lm's model has no "
            "pipeline(group) (use tensor parallel sharding)"
        )
    if n_layers < n:
        raise ModelLoadError(
            f"cannot split {n_layers} decoder layers across {n} ranks: use at most {n_layers} ranks"
        )
    model.model.pipeline(group)
    mx.eval(model.parameters())
    return _pipeline_sharding(model, group, "mlx-lm")


def _shard_uneven(model: Any, layers: list, group: Any, heads: Any) -> list:
    n, rank = group.size(), group.rank()
    if heads is None:
        raise ModelLoadError(
            f"cannot shard {type(model).__name__} across {n} ranks: it has no shard() of "
            "its own and its layers are not llama-style (self_attn.q_proj/k_proj/v_proj/"
            "o_proj, mlp.gate_proj/up_proj/down_proj)"
        )
    n_heads, n_kv, head_dim = heads
    if n_kv < n:
        raise ModelLoadError(
            f"cannot shard {type(model).__name__} across {n} ranks: it has {n_kv} key/value "
            f"heads, and each rank needs at least one; use at most {n_kv} ranks"
        )
    group_size = n_heads // n_kv
    kv_counts = _split(n_kv, n)
    kv0 = sum(kv_counts[:rank])
    kv1 = kv0 + kv_counts[rank]
    per = [(c * group_size, c) for c in kv_counts]
    for i, layer in enumerate(layers):
        a, mlp = layer.self_attn, getattr(layer, "mlp", None)
        names = ("gate_proj", "up_proj", "down_proj")
        if mlp is None or not all(hasattr(mlp, k) for k in names):
            raise ModelLoadError(
                f"cannot shard layer {i} of {type(model).__name__}: its MLP is not "
                "gate_proj/up_proj/down_proj"
            )
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, *(getattr(mlp, k) for k in names)):
            if type(lin) is not nn.Linear:
                raise ModelLoadError(
                    f"cannot shard layer {i} of {type(model).__name__} unevenly: "
                    f"{type(lin).__name__} layers are not supported (dense nn.Linear only); "
                    f"use a number of ranks that divides its {n_heads} heads and {n_kv} "
                    "key/value heads, or a float model"
                )
        q0, q1 = kv0 * group_size * head_dim, kv1 * group_size * head_dim
        k0, k1 = kv0 * head_dim, kv1 * head_dim
        a.q_proj = ColumnShard(a.q_proj, q0, q1)
        a.k_proj = ColumnShard(a.k_proj, k0, k1)
        a.v_proj = ColumnShard(a.v_proj, k0, k1)
        a.o_proj = RowShard(a.o_proj, q0, q1, group)
        a.n_heads = (kv1 - kv0) * group_size
        a.n_kv_heads = kv1 - kv0
        inter = mlp.gate_proj.weight.shape[0]
        cuts = _split(inter, n)
        m0 = sum(cuts[:rank])
        m1 = m0 + cuts[rank]
        mlp.gate_proj = ColumnShard(mlp.gate_proj, m0, m1)
        mlp.up_proj = ColumnShard(mlp.up_proj, m0, m1)
        mlp.down_proj = RowShard(mlp.down_proj, m0, m1, group)
    return per


# -- keeping the ranks in step ----------------------------------------------------

#: Record layout of one rank's part of a synchronisation (int32 fields).
_STATUS, _PHASE, _ROUND, _N, _HASH_LO, _HASH_HI, _CHOSEN, _K, _Q, _X0, _X1, _X2 = range(12)
_HEADER = 12
#: Bytes of an error message carried in a failing rank's record (UTF-8, cut).
_MSG_BYTES = 256

OK, FAILED, CLOSED = 0, 1, 2
START, ROUND, FINAL = 0, 1, 2
_PHASES = {START: "the start of the request", ROUND: "round", FINAL: "the end of the request"}

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def _fnv(h: int, tokens: Sequence[int]) -> int:
    for t in tokens:
        h = ((h ^ (int(t) & 0xFFFFFFFF)) * _FNV_PRIME) & _MASK64
    return h


@attrs.define
class _RowSync:
    """Per-request state of the synchronisation."""

    hashed: int = 0
    hash: int = _FNV_OFFSET
    rounds: int = 0
    #: the tokens of a round whose sync has run and whose forward has not been built:
    #: a failing rank must still run that forward.
    owed: Any = None
    #: the lazily computed output of the round's forward, once built (a failing rank
    #: evaluates it: exactly that forward's collectives).
    in_flight: Any = None
    #: the last synchronised round has been emitted (a failure now is in the next one).
    round_closed: bool = True
    syncs: int = 0
    forwards: int = 0
    overrides: int = 0
    q_broadcasts: int = 0
    failed: bool = False

    def history_hash(self, history: Sequence[int]) -> int:
        if len(history) < self.hashed:  # never shrinks within a request
            self.hashed, self.hash = 0, _FNV_OFFSET
        self.hash = _fnv(self.hash, history[self.hashed :])
        self.hashed = len(history)
        return self.hash


class RankSync:
    """Keeps the ranks of a sharded model's pipeline in step (see the module docs).

    One per :class:`~specdec.Pipeline` on a sharded model; each request gets its own
    state from :meth:`open`.

    Args:
        sharding: how the model is split (its group is the one synchronised).
        max_block: the policy's largest block (the record's block field).
        drafters: the policy's drafters, in order (a record names one by its index).
    """

    def __init__(self, sharding: Sharding, max_block: int, drafters: Sequence[Any]):
        self.sharding = sharding
        self.group = sharding.group
        self.size = self.group.size()
        self.rank = self.group.rank()
        self.max_block = int(max_block)
        self.drafters = list(drafters)
        self.names = [d.name for d in self.drafters]
        self.width = _HEADER + self.max_block + _MSG_BYTES // 4

    def open(self) -> _RowSync:
        """Fresh per-request state."""
        return _RowSync()

    # -- the records -----------------------------------------------------------

    def _exchange(self, st: _RowSync, rec: np.ndarray) -> np.ndarray:
        """All-gather one record per rank: ``[ranks, width]`` on every rank."""
        out = mx.distributed.all_gather(mx.array(rec), group=self.group)
        st.syncs += 1
        return np.array(out, copy=False).reshape(self.size, self.width)

    def _record(self, st: _RowSync, phase: int, history: Sequence[int]) -> np.ndarray:
        rec = np.zeros(self.width, dtype=np.int32)
        h = st.history_hash(history)
        rec[_PHASE], rec[_ROUND], rec[_N] = phase, st.rounds, len(history)
        rec[_HASH_LO], rec[_HASH_HI] = h & 0x7FFFFFFF, (h >> 31) & 0x7FFFFFFF
        return rec

    @staticmethod
    def _message(rec: np.ndarray, text: str) -> None:
        raw = text.encode("utf-8", "replace")[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
        rec[-_MSG_BYTES // 4 :] = np.frombuffer(raw, dtype=np.int32)

    @staticmethod
    def _text(rec: np.ndarray) -> str:
        raw = rec[-_MSG_BYTES // 4 :].astype(np.int32).tobytes()
        return raw.rstrip(b"\0").decode("utf-8", "replace")

    def _where(self, phase: int, rnd: int) -> str:
        return f"round {rnd}" if phase == ROUND else _PHASES[phase]

    def _check(self, st: _RowSync, recs: np.ndarray) -> None:
        """Raise on every rank alike when a rank failed or the ranks disagree."""
        bad = [r for r in range(self.size) if recs[r, _STATUS] != OK]
        if bad:
            r = bad[0]
            where = self._where(int(recs[r, _PHASE]), int(recs[r, _ROUND]))
            if recs[r, _STATUS] == CLOSED:
                msg = f"rank {r} stopped reading the stream at {where}"
            else:
                msg = f"rank {r} failed at {where}: {self._text(recs[r])}"
            raise DistributedError(
                f"{msg}; the request ended on all {self.size} ranks"
                + (f" (ranks failing: {bad})" if len(bad) > 1 else "")
            )
        keys = (_PHASE, _ROUND, _N, _HASH_LO, _HASH_HI)
        ref = recs[0, list(keys)]
        for r in range(1, self.size):
            if not np.array_equal(recs[r, list(keys)], ref):
                where = self._where(int(recs[0, _PHASE]), int(recs[0, _ROUND]))
                raise DistributedError(
                    f"ranks diverged at {where}: rank 0 has committed {int(recs[0, _N])} "
                    f"tokens (hash {self._hash_of(recs[0]):016x}) in round "
                    f"{int(recs[0, _ROUND])}, rank {r} {int(recs[r, _N])} tokens (hash "
                    f"{self._hash_of(recs[r]):016x}) in round {int(recs[r, _ROUND])}; "
                    "every rank must take the same decisions (the same model shards, "
                    "prompt, sampling arguments and policy)"
                )

    @staticmethod
    def _hash_of(rec: np.ndarray) -> int:
        return int(rec[_HASH_LO]) | (int(rec[_HASH_HI]) << 31)

    # -- the synchronisation points ----------------------------------------------

    def start(self, st: _RowSync, history: Sequence[int], request: Sequence[int], seed: int) -> int:
        """Before the request's sessions are made: compare the request (``history`` is
        the prompt; ``request`` small ints that must agree, e.g. max_tokens) and return
        rank 0's ``seed`` (64 bits: what position keys use).

        Raises:
            DistributedError: another rank got another request.
        """
        rec = self._record(st, START, history)
        seed &= _MASK64
        rec[_X0], rec[_X1], rec[_X2] = seed & 0x7FFFFFFF, (seed >> 31) & 0x7FFFFFFF, seed >> 62
        for i, v in enumerate(request[: self.width - _HEADER]):
            rec[_HEADER + i] = int(v) & 0x7FFFFFFF
        recs = self._exchange(st, rec)
        self._check(st, recs)
        for r in range(1, self.size):
            n = min(len(request), self.width - _HEADER)
            if not np.array_equal(recs[r, _HEADER : _HEADER + n], recs[0, _HEADER : _HEADER + n]):
                raise DistributedError(
                    f"rank {r} got another request than rank 0 (its max_tokens, sampling "
                    "or stop arguments differ): every rank must run the same request"
                )
        x = recs[0]
        return int(x[_X0]) | (int(x[_X1]) << 31) | (int(x[_X2]) << 62)

    def opened(self, st: _RowSync, history: Sequence[int], sessions: int) -> None:
        """After every rank made its ``sessions`` drafter sessions (0: it decodes plainly,
        e.g. a cache it cannot roll back), before prefill: hear of a rank that failed,
        and refuse ranks that would not all speculate alike.

        Raises:
            DistributedError: another rank failed to open the request, or the ranks'
                sessions differ.
        """
        rec = self._record(st, START, history)
        rec[_K] = sessions
        recs = self._exchange(st, rec)
        self._check(st, recs)
        for r in range(1, self.size):
            if recs[r, _K] != recs[0, _K]:
                raise DistributedError(
                    f"rank {r} opened the request with {int(recs[r, _K])} drafter sessions and "
                    f"rank 0 with {int(recs[0, _K])}: on one rank speculation is off (see its "
                    "stats.speculation_off_reason, e.g. a cache its rollbacks cannot serve), so "
                    "the ranks cannot verify the same blocks"
                )

    def round(self, st: _RowSync, history: Sequence[int], rnd: Any) -> bool:
        """Before a round's verify forward: check the ranks agree on what they committed,
        and make every rank verify rank 0's block. Returns whether the block was changed
        (its ``q`` then needs :meth:`broadcast_q` when it has one).

        ``rnd`` has ``chosen`` (a drafter name or ``None``), ``block`` (a tuple or lazy
        array) and ``q``; they are replaced by rank 0's.

        Raises:
            DistributedError: a rank failed, or the ranks' committed tokens differ.
        """
        st.rounds += 1
        st.round_closed = False
        rec = self._record(st, ROUND, history)
        block = settle(rnd)  # the block becomes a tuple here, before the exchange
        # never raise before the exchange (the other ranks would wait in it): the
        # pipeline caps blocks at max_block already
        k = min(len(block), self.max_block) if rnd.chosen is not None else 0
        rec[_CHOSEN] = 0 if rnd.chosen is None else self.names.index(rnd.chosen) + 1
        rec[_K] = k
        rec[_Q] = 1 if (rnd.chosen is not None and rnd.q is not None) else 0
        rec[_HEADER : _HEADER + k] = block[:k]
        recs = self._exchange(st, rec)
        self._check(st, recs)
        same = all(
            np.array_equal(recs[r, _CHOSEN : _Q + 1], recs[0, _CHOSEN : _Q + 1])
            and np.array_equal(
                recs[r, _HEADER : _HEADER + int(recs[0, _K])],
                recs[0, _HEADER : _HEADER + int(recs[0, _K])],
            )
            for r in range(1, self.size)
        )
        chosen = int(recs[0, _CHOSEN])
        k0 = int(recs[0, _K])
        mine = (
            int(rec[_CHOSEN]) == chosen
            and k == k0
            and tuple(int(t) for t in recs[0, _HEADER : _HEADER + k0]) == block[:k]
        )
        if not mine:
            st.overrides += 1
            rnd.chosen = None if chosen == 0 else self.names[chosen - 1]
            rnd.block = tuple(int(t) for t in recs[0, _HEADER : _HEADER + k0]) if chosen else ()
            if rnd.chosen is not None:
                rnd.proposals[rnd.chosen] = rnd.block
        st.owed, st.in_flight = (history[-1], *rnd.block), None
        needs_q = bool(recs[0, _Q])
        if not needs_q:
            rnd.q = None
            return False
        deterministic = bool(optional(self.drafters[chosen - 1], "drafter", "deterministic"))
        if same and deterministic:
            return False
        rnd.q = self.broadcast_q(st, rnd.q if self.rank == 0 else None)
        return True

    def broadcast_q(self, st: _RowSync, q: Any) -> mx.array:
        """Rank 0's draft probabilities ``[k, vocab]`` on every rank (one ``all_sum`` of
        rank 0's array and zeros elsewhere, after its shape)."""
        shape = np.zeros(2, dtype=np.int32)
        if q is not None:
            shape[:] = q.shape[0], q.shape[1]
        shapes = np.array(mx.distributed.all_gather(mx.array(shape), group=self.group))
        rows, vocab = int(shapes[0]), int(shapes[1])
        mine = q if q is not None else mx.zeros((rows, vocab), dtype=mx.float32)
        out = mx.distributed.all_sum(mine.astype(mx.float32), group=self.group)
        mx.eval(out)  # part of the synchronisation: never left for a failing rank to skip
        st.syncs += 2
        st.q_broadcasts += 1
        return out

    def round_done(self, st: _RowSync) -> None:
        """The round's tokens were committed and emitted."""
        st.round_closed = True

    def built(self, st: _RowSync, out: Any) -> None:
        """The round's forward was built (``out``: its lazy result, the logits)."""
        st.owed, st.in_flight = None, out
        st.forwards += 1

    def finish(self, st: _RowSync, history: Sequence[int]) -> None:
        """The stream ended here: compare the final histories, hear of late failures.

        Raises:
            DistributedError: as :meth:`round`.
        """
        rec = self._record(st, FINAL, history)
        self._check(st, self._exchange(st, rec))

    def fail(
        self,
        st: _RowSync,
        history: Sequence[int],
        exc: BaseException | None,
        *,
        phase: int = ROUND,
        rerun: Any = None,
    ) -> None:
        """This rank failed (``exc``; ``None``: its consumer closed the stream): finish the
        forward the other ranks are running, then tell them at their next
        synchronisation point. Never raises (the caller re-raises its own error).

        ``rerun(tokens)``: runs a forward of the model over ``tokens`` (the round's, kept
        in the state's ``owed``) when the round's forward was owed but never built.
        What went wrong while completing the forward is added to ``exc``'s notes; the
        record is sent all the same.
        """
        if st.failed:
            return
        st.failed = True
        try:
            if st.owed is not None:
                if rerun is not None:
                    rerun(st.owed)
            elif st.in_flight is not None:
                mx.eval(st.in_flight)
        except Exception as inner:  # noqa: BLE001 - reported on the failing rank's error
            _note(exc, f"specdec: completing the round's forward failed too: {inner!r}")
        st.in_flight = st.owed = None
        try:
            rec = self._record(st, phase, history)
            if phase == ROUND and st.round_closed:  # failed while planning the next round
                rec[_ROUND] += 1
            rec[_STATUS] = CLOSED if exc is None else FAILED
            if exc is not None:
                self._message(rec, f"{type(exc).__name__}: {exc}")
            self._exchange(st, rec)
        except Exception as inner:  # noqa: BLE001 - a broken link: the others' sockets close
            _note(exc, f"specdec: telling the other ranks failed: {inner!r}")

    def stats(
        self, st: _RowSync, forwards_prefill: int, tokens: int, *, final_sync: bool = False
    ) -> dict:
        """The request's ``stats.distributed`` (``final_sync``: count the synchronisation
        at the end of the request, which runs after the last token is yielded)."""
        per = self.sharding.collectives_per_forward
        model_ops = per * st.forwards
        syncs = st.syncs + (1 if final_sync else 0)
        total = model_ops + syncs
        return {
            **self.sharding.to_dict(),
            "decode_forwards": st.forwards,
            "model_collectives": model_ops,
            "sync_collectives": syncs,
            "collectives": total,
            "collectives_per_token": total / tokens if tokens else 0.0,
            "prefill_collectives": per * forwards_prefill,
            "block_overrides": st.overrides,
            "q_broadcasts": st.q_broadcasts,
        }


class RankCoordinator(Coordinator):
    """A request's coordinator on a sharded model: keeps this rank in step with the others
    (see :class:`RankSync`): rank 0's seed, one synchronisation before each verify
    forward and one at the end; a failure on this rank completes the forward the other
    ranks run and tells them at their next synchronisation."""

    local = False

    def __init__(self, ranks: RankSync, model: Any):
        self.ranks = ranks
        self.model = model
        self.sync = ranks.open()

    def start(self, state: Any) -> None:
        s, req = state.sampler, state.request
        request = [
            req.max_tokens,
            round(s.temperature * 1e6),
            round(s.top_p * 1e6),
            s.top_k,
            round(s.min_p * 1e6),
            s.min_tokens_to_keep,
            len(state.stop_ids),
            *sorted(state.stop_ids)[:8],
            len(req.stop),
            len(state.processors),
            req.prefill_step_size,
        ]
        seed = self.ranks.start(self.sync, state.history, request, s.seed)
        state.sampler = attrs.evolve(s, seed=seed)

    def opened(self, state: Any) -> None:
        self.ranks.opened(self.sync, state.history, len(state.sessions))

    def prefill_failed(self, exc: BaseException, logits: Any, chunk: Sequence[int]) -> None:
        # Go on: the other ranks feed every chunk; this rank says so at the first round.
        if logits is not None:  # the chunk's forward was built: run it to the end
            mx.eval(logits)
        else:
            self.rerun(chunk)

    def rerun(self, tokens: Sequence[int]) -> None:
        """A forward of the model over ``tokens`` without caches, for a rank that owes the
        other ranks a forward it never built (it failed after the round's
        synchronisation, or part-way through building it): the collectives stay paired
        (their shapes depend only on how many tokens are fed), and nothing depends on
        caches a failed forward may have half-written."""
        mx.eval(self.model(mx.array([list(tokens)])))

    def round(self, state: Any, rnd: Any) -> None:
        # A lazy block is read back and its ids checked here, where a bad draft fails as
        # a drafter that raised in propose does (before the exchange).
        settle(rnd, state)
        self.ranks.round(self.sync, state.history, rnd)

    def built(self, out: Any) -> None:
        self.ranks.built(self.sync, out)

    def round_done(self) -> None:
        self.ranks.round_done(self.sync)

    def finish(self, state: Any) -> None:
        self.ranks.finish(self.sync, state.history)

    def fail(self, state: Any, exc: BaseException | None, *, opening: bool = False) -> None:
        if isinstance(exc, DistributedError):
            return  # raised alike on every rank at a synchronisation: nothing owed
        if opening:
            self.ranks.fail(self.sync, state.history, exc, phase=START)
        elif exc is None:  # the consumer closed the stream
            self.ranks.fail(self.sync, state.history, None)
        else:
            self.ranks.fail(self.sync, state.history, exc, rerun=self.rerun)

    def stats(self, state: Any) -> dict:
        # the synchronisation at the end of the request counts too
        return self.ranks.stats(
            self.sync, state.prefill_forwards, state.emitter.n_out, final_sync=True
        )


def _note(exc: BaseException | None, text: str) -> None:
    if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(text)
