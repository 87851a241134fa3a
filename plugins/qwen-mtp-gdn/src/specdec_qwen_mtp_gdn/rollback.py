"""The ``gdn_transaction`` cache rollback: exact speculative transactions for gated-delta-net state.

A GDN layer's ``ArraysCache`` holds ``[conv_state, recurrent_state]``; neither can
be trimmed. A transaction is armed on the cache at ``begin`` (before the verify
forward); while armed, the layer's call records what the strategy needs (see
:mod:`.recording`), and ``commit(n_fed, n_keep)`` rebuilds both states as if only
the first ``n_keep`` tokens had been fed:

* ``capture``: keep the recurrent state after every verified position during the
  forward; commit picks the one at ``n_keep``. No recomputation.
* ``tape``: keep the recurrence's inputs (decay ``g``, ``beta``, ``k``, ``v``, ``q``)
  and the pre-forward state; commit replays the ``n_keep`` accepted steps.
* ``rerun``: keep the layer's inputs; commit restores the pre-forward state and runs
  the layer again on the accepted prefix (only what the cache depends on is
  evaluated: the qkv/a/b projections, the conv and the recurrence).

In all three the conv state after the prefix is a slice of the conv input the
forward already built (``rerun`` rebuilds it).

Rows of a batch (``specdec.Batch``): ``commit(n_fed, n_keep)`` with one ``n_keep``
per row picks each row's own state: ``capture`` gathers row ``r``'s state after
its ``n_keep[r]`` tokens from the captured ones, ``tape`` replays each row's
accepted steps on that row alone, and the conv state is each row's own slice of
the conv input. ``rerun`` cannot commit rows by different amounts (its
``supports_batch`` is false: such rows decode plainly). Rows join a batch
prefilled alone, so their GDN state has no left padding. ``auto`` (the default) picks
``capture`` where mlx-lm's ops recurrence runs (CPU, CUDA) and ``tape`` where its
fused Metal kernel runs (capturing there would split the kernel into one launch
per token).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from specdec import PolicyError

from .recording import ARMED, CaptureError, Segment, install, is_gdn_class

NAME = "gdn_transaction"
STRATEGIES = ("capture", "tape", "rerun")


def default_strategy() -> str:
    """The cheapest exact strategy for the recurrence mlx-lm runs here."""
    if mx.metal.is_available() and mx.default_device() == mx.gpu:
        return "tape"
    return "capture"


def find_gdn_module(layer: Any) -> Any:
    """The one GDN module inside ``layer`` (a decoder layer), or ``None``."""
    try:
        found = [m for _, m in layer.named_modules() if is_gdn_class(type(m))]
    except AttributeError:
        return None
    return found[0] if len(found) == 1 else None


class GatedDeltaTransaction:
    """One GDN layer cache's transaction (see the module docstring).

    Args:
        cache: the layer's ``ArraysCache`` (``[conv_state, recurrent_state]``).
        strategy: ``capture``, ``tape`` or ``rerun``.
    """

    def __init__(self, cache: ArraysCache, strategy: str):
        self.cache = cache
        self.strategy = strategy
        self.before = list(cache.cache)
        self.segments: list[Segment] = []
        # A transaction left armed (never committed nor aborted) is replaced.
        setattr(cache, ARMED, self)

    def commit(self, n_fed: int, n_keep: Any) -> None:
        """Leave the cache as if only the first ``n_keep`` of the ``n_fed`` tokens had been
        fed; ``n_keep`` may be a sequence with one count per row of a batch.

        Raises:
            CaptureError: the tokens fed did not all go through the recorded layer call
                (the caller aborts, which restores the cache).
        """
        try:
            if isinstance(n_keep, int):
                self._commit(int(n_fed), int(n_keep))
            else:
                self._commit_rows(int(n_fed), [int(k) for k in n_keep])
        finally:
            self._disarm()

    def abort(self) -> None:
        """Restore the cache exactly as it was at ``begin``."""
        self.cache.cache = list(self.before)
        self._disarm()

    def _disarm(self) -> None:
        if getattr(self.cache, ARMED, None) is self:
            delattr(self.cache, ARMED)
        self.segments = []

    def _check_fed(self, n_fed: int) -> None:
        seen = sum(s.n for s in self.segments)
        if seen != n_fed:
            raise CaptureError(
                f"gdn_transaction: {seen} token(s) went through the recorded gated-delta layer "
                f"since begin, but commit says {n_fed} were fed; the model's layer was not "
                "recorded (unsupported model code?)"
            )

    def _commit_rows(self, n_fed: int, keeps: list[int]) -> None:
        self._check_fed(n_fed)
        if len(self.segments) != 1:
            raise CaptureError(
                "gdn_transaction: rows of a batch are committed from one forward, got "
                f"{len(self.segments)}"
            )
        seg = self.segments[0]
        rows = int(seg.inputs.shape[0])
        if len(keeps) != rows or not all(1 <= k <= n_fed for k in keeps):
            raise ValueError(f"commit({n_fed}, {keeps}) for a batch of {rows} rows")
        if all(k == n_fed for k in keeps):
            return
        if self.strategy == "capture":
            states = mx.stack(seg.states, axis=0)  # [n, B, ...]
            state = states[mx.array([k - 1 for k in keeps]), mx.arange(rows)]
        elif self.strategy == "tape":
            fn, q, k, v, g, beta, mask = seg.tape
            parts = []
            for r, j in enumerate(keeps):
                m = None if mask is None else mask[r : r + 1, :j]
                s0 = None if seg.state_in is None else seg.state_in[r : r + 1]
                one = (x[r : r + 1, :j] for x in (q, k, v, g, beta))
                parts.append(fn(*one, s0, m)[1])
            state = mx.concatenate(parts, axis=0)
        else:
            raise CaptureError(
                f"gdn_transaction: strategy {self.strategy!r} cannot commit the rows of a "
                "batch by different amounts; use 'capture' or 'tape'"
            )
        width = seg.conv_input.shape[1] - seg.n  # K - 1
        idx = mx.array(keeps)[:, None] + mx.arange(width)[None, :]
        conv = mx.take_along_axis(seg.conv_input, idx[:, :, None], axis=1)
        self.cache.cache = [conv, state]

    def _commit(self, n_fed: int, n_keep: int) -> None:
        if not 0 <= n_keep <= n_fed:
            raise ValueError(
                f"commit needs 0 <= n_keep <= n_fed, got n_fed={n_fed}, n_keep={n_keep}"
            )
        self._check_fed(n_fed)
        if n_keep == n_fed:
            return
        if n_keep == 0:
            self.cache.cache = list(self.before)
            return
        start = 0
        for seg in self.segments:
            if n_keep <= start + seg.n:
                break
            start += seg.n
        j = n_keep - start  # 1..seg.n tokens of this segment are kept
        if self.strategy == "rerun":
            self.cache.cache = list(seg.before)
            mask = None if seg.mask is None else seg.mask[:, :j]
            seg.call(seg.layer, seg.inputs[:, :j], mask, self.cache)
            return
        if self.strategy == "capture":
            state = seg.states[j - 1]
        else:
            fn, q, k, v, g, beta, mask = seg.tape
            mask = None if mask is None else mask[:, :j]
            _, state = fn(q[:, :j], k[:, :j], v[:, :j], g[:, :j], beta[:, :j], seg.state_in, mask)
        width = seg.conv_input.shape[1] - seg.n  # K - 1
        conv = mx.contiguous(seg.conv_input[:, j : j + width, :])
        self.cache.cache = [conv, state]


class GatedDeltaRollback:
    """Exact rollback of gated-delta-net layer caches (mlx-lm ``ArraysCache`` of GDN layers).

    Needs to know which layer owns each cache: the rollback plan gives it the model
    (``plan.model``); a cache list without a model, or an ``ArraysCache`` of a layer
    that is not a GDN layer (Mamba, ...), is not supported, so the request falls
    back to plain decoding instead of failing.

    Args:
        strategy: ``auto`` (default), ``capture``, ``tape`` or ``rerun``.
    """

    name = NAME

    def __init__(self, strategy: str = "auto"):
        if strategy == "auto":
            strategy = default_strategy()
        if strategy not in STRATEGIES:
            raise PolicyError(
                f"gdn_transaction option strategy must be one of {('auto', *STRATEGIES)}, "
                f"got {strategy!r}"
            )
        self.strategy = strategy
        # The stats list rollback names; this one says which strategy ran.
        self.name = f"{NAME}:{strategy}"
        self._owned: dict[int, tuple[Any, Any]] = {}

    @property
    def supports_batch(self) -> bool:
        """Whether it commits the rows of a batch by different amounts (``capture`` and
        ``tape``; not ``rerun``)."""
        return self.strategy in ("capture", "tape")

    def bind(self, plan: Any) -> None:
        """Map the plan's caches to the model's GDN layers and install the recording wrappers."""
        self._owned = {}
        model = getattr(plan, "model", None)
        layers = getattr(model, "layers", None) if model is not None else None
        if layers is None:
            return
        layers = list(layers)
        if len(layers) != len(plan.caches):
            return
        classes = set()
        for layer, cache in zip(layers, plan.caches):
            if type(cache) is not ArraysCache:
                continue
            module = find_gdn_module(layer)
            if module is not None:
                self._owned[id(cache)] = (cache, module)
                classes.add(type(module))
        if classes:
            install(sorted(classes, key=lambda c: (c.__module__, c.__qualname__)))

    def supports(self, cache: Any) -> bool:
        """An unpadded two-slot ``ArraysCache`` owned by a GDN layer of the bound model
        (a batch's cache whose left padding is all zeros counts as unpadded)."""
        entry = self._owned.get(id(cache))
        return (
            entry is not None
            and entry[0] is cache
            and len(cache.cache) == 2
            and (cache.left_padding is None or not any(cache.left_padding.tolist()))
            and cache.lengths is None
        )

    def begin(self, cache: Any) -> GatedDeltaTransaction:
        """Arm a transaction on ``cache`` (before the verify forward)."""
        return GatedDeltaTransaction(cache, self.strategy)
