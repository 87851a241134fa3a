"""Recording what a gated-delta-net layer computes while a transaction is armed on its cache.

mlx-lm's GDN layers (``qwen3_next.Qwen3NextGatedDeltaNet``, ``qwen3_5.GatedDeltaNet``
and any class whose ``__call__(self, inputs, mask=None, cache=None)`` calls
``gated_delta_update`` and ``self.conv1d``) keep ``cache[0]`` = the last K-1 conv
input rows and ``cache[1]`` = the recurrent state. Only the states *after* the
forward survive it, so an exact commit of an accepted prefix needs values that exist
only inside the forward. :func:`install` wraps, once and reversibly:

* the GDN class's ``__call__``: when the cache carries an armed transaction
  (attribute :data:`ARMED`), the original code runs on a thin view of the layer whose
  ``conv1d`` records its input (``[conv state; new qkv rows]``: the conv state after
  any prefix is a slice of it) and the layer's inputs are kept (for ``rerun``);
* ``mlx_lm.models.gated_delta.gated_delta_ops`` and ``gated_delta_kernel`` (the two
  recurrences ``gated_delta_update`` dispatches to): inside an armed layer call they
  keep the recurrent state after every step (``capture``) or their arguments
  (``tape``, replayed later from the pre-forward state).

With no transaction armed every wrapper calls straight through. The model's weights
and module tree are never modified.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models import gated_delta

#: Attribute an armed transaction sets on the ``ArraysCache`` it covers.
ARMED = "_specdec_gdn_transaction"

#: Strategies that need the recurrence's internals (the others only need the layer inputs).
LEAF_STRATEGIES = ("capture", "tape")

_local = threading.local()
_patched_classes: dict[type, Any] = {}  # class -> its original __call__
_patched_leaves: dict[str, Any] = {}  # gated_delta function name -> original


class CaptureError(RuntimeError):
    """The forward did not go through the code the transaction records; nothing is committed."""


def _current() -> Segment | None:
    return getattr(_local, "segment", None)


class Segment:
    """One armed call of a GDN layer: what a commit of a prefix of its tokens needs.

    Attributes:
        layer: the GDN module.
        call: the class's original ``__call__``.
        inputs: the layer's input ``[B, S, H]``.
        mask: the layer's mask argument.
        before: ``[conv_state, recurrent_state]`` of the cache before this call.
        n: tokens fed (``S``).
        conv_input: ``[B, K-1+S, C]``, the conv state before the call followed by the new rows.
        state_in: the recurrent state the recurrence started from.
        states: per-step recurrent states (``capture``).
        tape: ``(function, q, k, v, g, beta, mask)`` of the recurrence (``tape``).
    """

    __slots__ = (
        "layer",
        "call",
        "inputs",
        "mask",
        "before",
        "n",
        "strategy",
        "conv_input",
        "state_in",
        "states",
        "tape",
        "leaf_calls",
    )

    def __init__(
        self, layer: Any, call: Any, inputs: mx.array, mask: Any, cache: Any, strategy: str
    ):
        self.layer = layer
        self.call = call
        self.inputs = inputs
        self.mask = mask
        self.before = list(cache.cache)
        self.n = int(inputs.shape[1])
        self.strategy = strategy
        self.conv_input: mx.array | None = None
        self.state_in = None
        self.states: list | None = None
        self.tape: tuple | None = None
        self.leaf_calls = 0

    def check(self) -> None:
        """Fail loudly when the forward bypassed what this strategy records."""
        name = type(self.layer).__qualname__
        if self.strategy == "rerun":
            return
        if self.conv_input is None or self.conv_input.shape[1] < self.n:
            raise CaptureError(
                f"gdn_transaction: {name} did not pass its conv input through self.conv1d as "
                "expected; use strategy 'rerun' or a supported mlx-lm version"
            )
        if self.leaf_calls != 1:
            raise CaptureError(
                f"gdn_transaction: {name} reached mlx_lm.models.gated_delta's recurrence "
                f"{self.leaf_calls} times (expected once); cannot {self.strategy} its state. "
                "Use strategy 'rerun' or a supported mlx-lm version"
            )
        if self.strategy == "capture" and (self.states is None or len(self.states) != self.n):
            raise CaptureError(f"gdn_transaction: captured no per-step states for {name}")


class _LayerView:
    """The layer as its own ``__call__`` sees it, with ``conv1d`` recording its input."""

    __slots__ = ("_layer", "_segment")

    def __init__(self, layer: Any, segment: Segment):
        self._layer = layer
        self._segment = segment

    def __getattr__(self, name: str) -> Any:
        return getattr(self._layer, name)

    @property
    def conv1d(self) -> Any:
        conv, seg = self._layer.conv1d, self._segment

        def record(x: mx.array) -> mx.array:
            seg.conv_input = x
            return conv(x)

        return record


def _wrap_call(original: Any) -> Any:
    @functools.wraps(original)
    def __call__(self, inputs, mask=None, cache=None):
        txn = getattr(cache, ARMED, None) if cache is not None else None
        if txn is None:
            return original(self, inputs, mask, cache)
        seg = Segment(self, original, inputs, mask, cache, txn.strategy)
        previous = _current()
        _local.segment = seg
        try:
            out = original(_LayerView(self, seg), inputs, mask, cache)
        finally:
            _local.segment = previous
        seg.check()
        txn.segments.append(seg)
        return out

    __call__._specdec_gdn_original = original  # type: ignore[attr-defined]
    return __call__


def ops_with_states(q, k, v, g, beta, state=None, mask=None):
    """``gated_delta_ops`` that also returns the state after every step.

    Same per-step function (``gated_delta._gated_delta_step_ops``), same order:
    ``y`` and the final state are identical to ``gated_delta_ops``'s.

    Returns:
        ``(y, final_state, [state after step t for t in range(T)])``.
    """
    step = getattr(gated_delta, "_gated_delta_step_ops", None)
    if step is None:
        raise CaptureError(
            "gdn_transaction: this mlx-lm has no gated_delta._gated_delta_step_ops; "
            "use strategy 'tape' or 'rerun'"
        )
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, states = [], []
    for t in range(T):
        y, state = step(
            q[:, t],
            k[:, t],
            v[:, t],
            g[:, t],
            beta[:, t],
            state,
            None if mask is None else mask[:, t],
        )
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), state, states


def _kernel_with_states(kernel, q, k, v, g, beta, state, mask):
    """The Metal kernel one step at a time: exact when the state is float32 (its registers are)."""
    if state.dtype != mx.float32:
        raise CaptureError(
            f"gdn_transaction: capture on the Metal kernel path needs a float32 state, got "
            f"{state.dtype}; use strategy 'tape'"
        )
    ys, states = [], []
    for t in range(q.shape[1]):
        s = slice(t, t + 1)
        y, state = kernel(
            q[:, s],
            k[:, s],
            v[:, s],
            g[:, s],
            beta[:, s],
            state,
            None if mask is None else mask[:, s],
        )
        ys.append(y)
        states.append(state)
    return mx.concatenate(ys, axis=1), state, states


def _wrap_leaf(kind: str, original: Any) -> Any:
    @functools.wraps(original)
    def leaf(q, k, v, g, beta, state=None, mask=None):
        seg = _current()
        if seg is None or seg.strategy not in LEAF_STRATEGIES:
            return original(q, k, v, g, beta, state, mask)
        seg.leaf_calls += 1
        if state is None:
            B, _, _, Dk = q.shape
            Hv, Dv = v.shape[-2:]
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        seg.state_in = state
        if seg.strategy == "tape":
            seg.tape = (original, q, k, v, g, beta, mask)
            return original(q, k, v, g, beta, state, mask)
        if kind == "ops":
            y, final, states = ops_with_states(q, k, v, g, beta, state, mask)
        else:
            y, final, states = _kernel_with_states(original, q, k, v, g, beta, state, mask)
        seg.states = states
        return y, final

    leaf._specdec_gdn_original = original  # type: ignore[attr-defined]
    return leaf


def _original(fn: Any) -> Any:
    return getattr(fn, "_specdec_gdn_original", fn)


def is_gdn_class(cls: type) -> bool:
    """Whether ``cls.__call__`` is a GDN layer call this module can record.

    It must be ``__call__(self, inputs, mask=None, cache=None)``, call
    ``gated_delta_update`` and use ``self.conv1d``.
    """
    call = _original(
        next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
    )
    code = getattr(call, "__code__", None)
    if code is None:
        return False
    if "gated_delta_update" not in code.co_names or "conv1d" not in code.co_names:
        return False
    try:
        params = list(inspect.signature(call).parameters)
    except (TypeError, ValueError):
        return False
    return params == ["self", "inputs", "mask", "cache"]


def install(classes: list[type] = ()) -> None:
    """Wrap the recurrences (once) and each GDN class in ``classes`` (once each)."""
    for name, kind in (("gated_delta_ops", "ops"), ("gated_delta_kernel", "kernel")):
        if name not in _patched_leaves and hasattr(gated_delta, name):
            original = getattr(gated_delta, name)
            _patched_leaves[name] = original
            setattr(gated_delta, name, _wrap_leaf(kind, original))
    for cls in classes:
        if not is_gdn_class(cls):
            continue
        # wrap the class that defines __call__, so a subclass never wraps it twice
        owner = next(c for c in cls.__mro__ if "__call__" in c.__dict__)
        if owner not in _patched_classes:
            original = owner.__dict__["__call__"]
            _patched_classes[owner] = original
            owner.__call__ = _wrap_call(original)


def uninstall() -> None:
    """Restore every wrapped function and class."""
    for cls, original in list(_patched_classes.items()):
        cls.__call__ = original
        del _patched_classes[cls]
    for name, original in list(_patched_leaves.items()):
        setattr(gated_delta, name, original)
        del _patched_leaves[name]


def installed() -> dict:
    """What is wrapped now: ``{"classes": [...], "functions": [...]}`` (for tests and doctor output)."""
    return {
        "classes": sorted(f"{c.__module__}.{c.__qualname__}" for c in _patched_classes),
        "functions": sorted(f"mlx_lm.models.gated_delta.{n}" for n in _patched_leaves),
    }
