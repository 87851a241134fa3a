"""Taps on a model's own modules: read hidden states without rebuilding any step.

A tap changes the class of one module instance (the backbone, its final norm,
chosen decoder layers) to a subclass whose ``__call__`` first calls the
original and then records its output while a recording is open. The model's
forward is the model's own code, so the logits it returns are bit-identical to
``model(tokens, cache=...)``; its parameter tree is unchanged. Outside a
recording a tap only passes its call through.

The backbone's tap can also *substitute* its output: calling the model with
the backbone replaced by given hidden states runs exactly the model's output
path (output layer, logit scaling, final softcapping) on them, which is what
the ``exact`` draft head does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx

_TAP_ATTR = "_specdec_tap"
_TAPS_ATTR = "_specdec_taps"
_CLASSES: dict[type, type] = {}


class _Tap:
    """State of one tapped module instance."""

    __slots__ = ("value", "recording", "substitute")

    def __init__(self) -> None:
        self.value: Any = None
        self.recording = False
        self.substitute: Any = None


def _tapped_class(cls: type) -> type:
    """A subclass of ``cls`` whose calls record their output (made once per class)."""
    if getattr(cls, "_specdec_tapped", False):
        return cls
    sub = _CLASSES.get(cls)
    if sub is None:
        base_call = cls.__call__

        def __call__(self, *args, **kwargs):
            tap = self.__dict__.get(_TAP_ATTR)
            if tap is not None and tap.substitute is not None:
                return tap.substitute
            out = base_call(self, *args, **kwargs)
            if tap is not None and tap.recording:
                tap.value = out
            return out

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "_specdec_tapped": True})
        sub.__module__ = cls.__module__
        sub.__qualname__ = getattr(cls, "__qualname__", cls.__name__)
        _CLASSES[cls] = sub
    return sub


def _tap(module: Any) -> _Tap:
    tap = module.__dict__.get(_TAP_ATTR)
    if tap is None:
        tap = _Tap()
        object.__setattr__(module, _TAP_ATTR, tap)
        module.__class__ = _tapped_class(type(module))
    return tap


class TapError(TypeError):
    """The model is not shaped like an mlx-lm model the taps understand."""


class ModelTaps:
    """The taps of one model: backbone (``model.model``), its final norm and its layers.

    Use :func:`model_taps` to get the (single) instance of a model.
    """

    def __init__(self, model: Any):
        backbone = getattr(model, "model", None)
        norm = getattr(backbone, "norm", None) if backbone is not None else None
        layers = getattr(backbone, "layers", None) if backbone is not None else None
        if backbone is None or norm is None or not callable(norm) or layers is None:
            raise TapError(
                f"{type(model).__name__} is not shaped like an mlx-lm language model "
                "(model.model backbone with a final .norm and .layers); hidden states "
                "cannot be read from it"
            )
        self.model = model
        self.backbone = backbone
        self.n_layers = len(layers)
        self._backbone_tap = _tap(backbone)
        self._norm_tap = _tap(norm)
        self._layer_taps: dict[int, _Tap] = {}

    def layer_index(self, i: int) -> int:
        """``i`` as a non-negative layer index.

        Raises:
            IndexError: ``i`` is outside the model's layers.
        """
        j = i + self.n_layers if i < 0 else i
        if not 0 <= j < self.n_layers:
            raise IndexError(
                f"layer {i} is out of range: the model has {self.n_layers} decoder layers "
                f"(0..{self.n_layers - 1}, or -{self.n_layers}..-1)"
            )
        return j

    def _layer_tap(self, i: int) -> _Tap:
        j = self.layer_index(i)
        tap = self._layer_taps.get(j)
        if tap is None:
            tap = self._layer_taps[j] = _tap(self.backbone.layers[j])
        return tap

    @contextlib.contextmanager
    def recording(self, layers: Sequence[int] = ()) -> Iterator[dict]:
        """Record the final hidden states (``"hidden"``) and ``layers``' outputs during the block.

        Yields a dict filled when the block ends: ``{"hidden": h, "layers": {i: h_i}}``
        (arrays with the batch axis, as the modules returned them).
        """
        taps = [(i, self._layer_tap(i)) for i in layers]
        out: dict = {"hidden": None, "layers": {}}
        self._norm_tap.recording = True
        for _, t in taps:
            t.recording = True
        try:
            yield out
        finally:
            self._norm_tap.recording = False
            out["hidden"] = self._norm_tap.value
            self._norm_tap.value = None
            for i, t in taps:
                t.recording = False
                v = t.value
                out["layers"][i] = v[0] if isinstance(v, (tuple, list)) else v
                t.value = None

    def head(self, hidden: mx.array) -> mx.array:
        """The model's own output path applied to ``hidden`` (``[B, n, H]``): logits ``[B, n, V]``."""
        tap = self._backbone_tap
        tap.substitute = hidden
        try:
            return self.model(mx.zeros(hidden.shape[:2], dtype=mx.int32))
        finally:
            tap.substitute = None


def model_taps(model: Any) -> ModelTaps:
    """The taps of ``model``, installed on first use (idempotent).

    Raises:
        TapError: the model has no ``model.model`` backbone with ``norm`` and ``layers``.
    """
    taps = model.__dict__.get(_TAPS_ATTR)
    if taps is None:
        taps = ModelTaps(model)
        object.__setattr__(model, _TAPS_ATTR, taps)
    return taps
