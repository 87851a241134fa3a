"""Draft heads: the built-in ``exact`` head (the target's own output path) and
:class:`OutputLayer`, the target's output layer as rows, for heads that score only
some tokens exactly (a coarse head rescoring its best candidates)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .capture import model_taps
from .errors import ModelLoadError
from .roles import optional


def model_vocab_size(model: Any) -> int | None:
    """The vocabulary size of an mlx-lm model (``args.vocab_size``, else the embedding rows)."""
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if v is None:
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
        w = getattr(emb, "weight", None)
        v = None if w is None else w.shape[0]
    return int(v) if v is not None else None


class ExactHead:
    """Draft logits from the target's own output path (head, logit scaling, softcapping).

    Exactly the logits the target would give for the same hidden states; the
    reference every other head is measured against.
    """

    name = "exact"

    def __init__(self) -> None:
        self.vocab_size: int | None = None
        self._taps = None
        self.calls = 0

    def bind(self, model: Any) -> None:
        """Tap ``model``'s backbone so hidden states can be run through its output path."""
        self._taps = model_taps(model)
        self.vocab_size = model_vocab_size(model)

    def logits(self, hidden: mx.array, context: Sequence[int] | None = None) -> mx.array:
        """``[n, H]`` (or ``[B, n, H]``) hidden states -> float32 logits ``[n, V]`` (``[B, n, V]``).

        ``context`` (the request's tokens so far) is not needed here."""
        if self._taps is None:
            raise RuntimeError("draft head 'exact' is not bound to a model (bind(model) first)")
        self.calls += 1
        if hidden.ndim == 2:
            return self._taps.head(hidden[None])[0].astype(mx.float32)
        return self._taps.head(hidden).astype(mx.float32)

    def stats(self) -> dict:
        """Calls made."""
        return {"kind": "exact", "calls": self.calls}


# -- the output layer as rows ------------------------------------------------------

#: Where mlx-lm models keep the constants of what follows the output layer, and how
#: they apply them (``(attribute, kind)``); tried in this order on a probe.
_POST_ATTRS = (
    ("final_logit_softcapping", "softcap"),  # gemma2, gemma3n, gemma4: tanh(z / c) * c
    ("logit_scale", "mul"),  # cohere: z * c
    ("logits_scaling", "div"),  # granite: z / c
)


def _post_constant(model: Any, attr: str) -> float | None:
    for obj in (
        model,
        getattr(model, "args", None),
        getattr(getattr(model, "model", None), "args", None),
    ):
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v:
            return float(v)
    return None


def _apply_post(z: mx.array, post: tuple[str, float] | None) -> mx.array:
    if post is None:
        return z
    kind, c = post
    if kind == "softcap":
        return mx.tanh(z / c) * c
    if kind == "mul":
        return z * c
    return z / c


class OutputLayer:
    """The target's output layer read as rows: exact logits of chosen tokens.

    Finds the layer the model's output path applies (``lm_head``, or the tied
    embedding's ``as_linear``; dense or quantized, with or without a bias) and what
    follows it (soft-capping, a logit scale), and checks on random states that
    ``post(layer(h))`` is the model's own output path. :meth:`rows` computes the
    logits of some tokens with the layer's own arithmetic on those rows (quantized
    rows through ``quantized_matmul``), so they equal the whole head's logits for
    those tokens within float32 rounding: BLAS orders a matmul's sums by its shape,
    so a narrower product can differ in the last bits (measured on SmolLM2's head:
    at most 1.2e-5 on logits of about 20), as the full head's own logits differ
    between a one-token step and a block. Shared by every head built for one model
    (:func:`output_layer`).

    Attributes:
        vocab_size, hidden_size: the layer's shape.
        quantized: ``(bits, group_size, mode)`` of a quantized layer, else ``None``.
        tied: the layer is the input embedding's.
        post: ``None``, or ``(kind, constant)`` with kind ``softcap``, ``mul`` or ``div``.
        dtype: the dtype of the layer's (dequantized) weights.

    Raises:
        ModelLoadError: the model has no output layer this reads, or its output path
            is not that layer followed by a known scaling (naming what was found).
    """

    def __init__(self, model: Any):
        taps = model_taps(model)
        kinds = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
        # An lm_head, else the tied input embedding; a model that keeps an lm_head but
        # ties (gemma3 after loading a checkpoint without one) is told apart by probing.
        found = [
            (layer, tied)
            for layer, tied in (
                (getattr(model, "lm_head", None), False),
                # a text model wrapped as language_model (qwen3_5, multimodal checkpoints)
                (getattr(getattr(model, "language_model", None), "lm_head", None), False),
                (getattr(taps.backbone, "embed_tokens", None), True),
            )
            if isinstance(layer, kinds)
        ]
        if not found:
            raise ModelLoadError(
                f"{type(model).__name__}: no output layer to read as rows (an lm_head that is "
                "an mlx.nn Linear/QuantizedLinear, or a tied Embedding/QuantizedEmbedding)"
            )
        error = None
        for layer, tied in found:
            self._set_layer(layer, tied)
            try:
                self.post = self._find_post(model, taps)
                return
            except ModelLoadError as exc:
                error = error or exc
        raise error

    def _set_layer(self, layer: Any, tied: bool) -> None:
        self.layer, self.tied = layer, tied
        self.weight = layer["weight"]
        self.bias = (
            layer.get("bias") if isinstance(layer, (nn.Linear, nn.QuantizedLinear)) else None
        )
        if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            self.quantized = (
                int(layer.bits),
                int(layer.group_size),
                getattr(layer, "mode", "affine"),
            )
            self.scales, self.biases = layer["scales"], layer.get("biases")
            self.vocab_size = int(self.weight.shape[0])
            self.dtype = self.scales.dtype
            self.hidden_size = int(self.weight.shape[1]) * 32 // self.quantized[0]
        else:
            self.quantized, self.scales, self.biases = None, None, None
            self.vocab_size, self.hidden_size = (int(d) for d in self.weight.shape)
            self.dtype = self.weight.dtype

    def _linear(self, h: mx.array) -> mx.array:
        if isinstance(self.layer, (nn.Embedding, nn.QuantizedEmbedding)):
            return self.layer.as_linear(h)
        return self.layer(h)

    def _find_post(self, model: Any, taps: Any) -> tuple[str, float] | None:
        probe = mx.random.normal((1, 4, self.hidden_size), key=mx.random.key(7)) * 2.0
        probe = probe.astype(self.dtype)
        ref = taps.head(probe)
        z = self._linear(probe)
        tried = [None] + [
            (kind, c)
            for attr, kind in _POST_ATTRS
            if (c := _post_constant(model, attr)) is not None
        ]
        close: list = []  # the posts that match up to rounding, in the order tried
        for post in tried:
            out = _apply_post(z, post)
            if out.shape != ref.shape:
                break
            if bool(mx.array_equal(out, ref)):
                return post
            tol = 1e-3 if self.dtype == mx.float32 else 5e-2
            if bool(mx.allclose(out, ref, rtol=tol, atol=tol)):
                close.append(post)
        if close:  # the same operations up to rounding (another kernel order)
            return close[0]
        names = ", ".join(["none"] + [f"{k} {c:g}" for k, c in (p for p in tried if p)])
        raise ModelLoadError(
            f"{type(model).__name__}: its output path is not its output layer "
            f"({type(self.layer).__name__}{', tied' if self.tied else ''}) followed by a "
            f"known scaling (tried: {names}); a head that scores rows of it cannot be built"
        )

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits of every token for ``hidden`` ``[n, H]``: ``[n, V]`` float32 (the model's
        own output path)."""
        return _apply_post(self._linear(hidden), self.post).astype(mx.float32)

    def rows(self, hidden: mx.array, ids: mx.array) -> mx.array:
        """Exact logits of the tokens ``ids`` (``[c]``, or ``[n, c]``: per state) for
        ``hidden`` ``[n, H]``: ``[n, c]`` float32."""
        if ids.ndim == 2:
            return mx.concatenate(
                [self.rows(hidden[i : i + 1], ids[i]) for i in range(ids.shape[0])], axis=0
            )
        if self.quantized is not None:
            bits, gs, mode = self.quantized
            z = mx.quantized_matmul(
                hidden,
                self.weight[ids],
                self.scales[ids],
                None if self.biases is None else self.biases[ids],
                transpose=True,
                group_size=gs,
                bits=bits,
                mode=mode,
            )
        else:
            z = hidden @ self.weight[ids].T
        if self.bias is not None:
            z = z + self.bias[ids]
        return _apply_post(z, self.post).astype(mx.float32)

    def _dense(self, index: Any) -> mx.array:
        if self.quantized is None:
            return self.weight[index]
        bits, gs, mode = self.quantized
        return mx.dequantize(
            self.weight[index],
            self.scales[index],
            None if self.biases is None else self.biases[index],
            group_size=gs,
            bits=bits,
            mode=mode,
        )

    def dense(self, start: int = 0, stop: int | None = None) -> mx.array:
        """Rows ``start:stop`` of the layer's weights as a dense ``[rows, H]`` matrix in the
        layer's dtype (dequantized when quantized); build big copies in row chunks."""
        return self._dense(slice(start, self.vocab_size if stop is None else stop))

    def take(self, ids: mx.array) -> mx.array:
        """The layer's rows ``ids`` as a dense ``[len(ids), H]`` matrix (layer dtype)."""
        return self._dense(ids)

    def describe(self) -> dict:
        """What was found, JSON-able."""
        return {
            "layer": type(self.layer).__name__,
            "tied": self.tied,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "dtype": str(self.dtype).replace("mlx.core.", ""),
            "quantized": None if self.quantized is None else list(self.quantized),
            "post": None if self.post is None else list(self.post),
            "bias": self.bias is not None,
        }


_OUTPUT_LAYER_ATTR = "_specdec_output_layer"


def output_layer(model: Any) -> OutputLayer:
    """The :class:`OutputLayer` of ``model``, made once per model object."""
    ol = model.__dict__.get(_OUTPUT_LAYER_ATTR)
    if ol is None:
        ol = OutputLayer(model)
        object.__setattr__(model, _OUTPUT_LAYER_ATTR, ol)
    return ol


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` takes keyword ``name`` (or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        p.name == name
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        or p.kind == p.VAR_KEYWORD
        for p in params
    )


class _ContextFreeHead:
    """A head written before 0.2.4, whose ``logits`` takes no ``context``: drops it."""

    def __init__(self, head: Any):
        self._head = head

    def logits(self, hidden: mx.array, context: Sequence[int] | None = None) -> mx.array:
        return self._head.logits(hidden)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)


def bind_head(head: Any, model: Any, tokenizer: Any = None) -> Any:
    """Bind ``head`` to ``model`` (and ``tokenizer`` where its ``bind`` takes one); the
    head to hand to drafters, whose ``logits`` takes ``context=``."""
    bind = optional(head, "draft_head", "bind")
    if bind is not None:
        if accepts_keyword(bind, "tokenizer"):
            bind(model, tokenizer=tokenizer)
        else:
            bind(model)
    if not accepts_keyword(head.logits, "context"):
        return _ContextFreeHead(head)
    return head
