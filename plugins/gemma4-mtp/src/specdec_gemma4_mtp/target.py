"""The target side: which of the target's caches the assistant reads, and how.

Gemma 4 shares K/V across its last ``num_kv_shared_layers`` layers: each of them reads
the K/V of the last earlier layer of its type, and only the layers before them own a
cache (mlx-lm's ``make_cache`` returns one per owning layer). The assistant reads, per
layer type (sliding / full attention), the K/V of the **last owning layer of that
type**: the same tensors the target's shared layers attend to. Other mlx-lm models
(llama, qwen, ...) have one layer type, ``full_attention``, and every layer owns its
cache: the assistant reads the last layer's.

The keys in the cache are already normed and rotated by the target, so the assistant's
queries are rotated with the donor layer's own RoPE (the function that rotated the
keys) and scaled as the donor layer scales its own (1.0 in Gemma 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import specdec

from .assistant import AssistantConfig, AssistantLoadError, check_layer_types, embed_scale


def text_model(model: Any) -> Any:
    """The language model inside ``model`` (``model`` itself, or its ``language_model``)."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and hasattr(inner, "model") else model


@attrs.frozen
class Donor:
    """The target layer whose K/V a layer type of the assistant reads."""

    layer: int  # index of the layer (= index of its cache in the cache list)
    rope: Any  # its RoPE module
    scale: float  # its attention scale
    kv_heads: int
    head_dim: int


@attrs.define
class TargetBinding:
    """What the assistant needs of one target model.

    Attributes:
        model: the target (as handed to the pipeline).
        hidden_size: ``H_target``.
        vocab_size: the target's vocabulary.
        embed: the target's input embedding module.
        scale: ``sqrt(H_target)``, the factor on its embeddings.
        donors: per layer type, the :class:`Donor`.
        layer_types: the target's layer types, per layer.
    """

    model: Any
    hidden_size: int
    vocab_size: int
    embed: Any
    scale: float
    donors: dict
    layer_types: tuple

    def embed_tokens(self, tokens: mx.array) -> mx.array:
        """The scaled target embeddings of ``tokens``."""
        return self.embed(tokens) * self.scale

    def check_caches(self, caches: Sequence[Any], types: Sequence[str]) -> None:
        """Raise unless every donor of ``types`` has a cache :func:`specdec.kvview.kv_view` reads.

        Raises:
            AssistantLoadError: naming the layer and what its cache is.
        """
        from mlx_lm.models import cache as mlx_cache

        readable = tuple(
            c
            for c in (
                mlx_cache.KVCache,
                mlx_cache.RotatingKVCache,
                getattr(mlx_cache, "QuantizedKVCache", None),
            )
            if c is not None
        )
        for t in dict.fromkeys(types):
            d = self.donors[t]
            if d.layer >= len(caches):
                raise AssistantLoadError(
                    f"gemma4_mtp: the target has {len(caches)} caches, none for layer {d.layer} "
                    f"whose {t} K/V the assistant reads"
                )
            c = caches[d.layer]
            if type(c) not in readable:
                raise AssistantLoadError(
                    f"gemma4_mtp: the target's cache of layer {d.layer} ({t}) is a "
                    f"{type(c).__name__}, whose K/V cannot be read; the assistant reads "
                    f"{[k.__name__ for k in readable]}"
                )

    def kv(self, caches: Sequence[Any], types: Sequence[str]) -> dict:
        """Per layer type in ``types``, the committed ``(keys, values)`` of its donor cache.

        Sliding caches give their last ``window`` entries (a query that adds no key of its
        own attends to all of them). ``None`` when a donor cache holds nothing yet.
        """
        out = {}
        for t in dict.fromkeys(types):
            v = specdec.kvview.kv_view(caches[self.donors[t].layer], full_window=True)
            if v is None or v.length == 0:
                return None
            out[t] = (v.keys, v.values)
        return out


def _attn(layer: Any) -> Any:
    return getattr(layer, "self_attn", None) or getattr(layer, "attention", None)


def bind_target(model: Any, cfg: AssistantConfig) -> TargetBinding:
    """Find the donors of ``cfg``'s layer types in ``model`` and check that the pair fits.

    Raises:
        AssistantLoadError: the target is not an mlx-lm language model with attention
            layers, has no layer of a type the assistant reads, or its hidden size,
            vocabulary or K/V heads do not match the assistant's (before any model work).
    """
    tm = text_model(model)
    backbone = getattr(tm, "model", None)
    layers = getattr(backbone, "layers", None)
    embed = getattr(backbone, "embed_tokens", None)
    if layers is None or embed is None:
        raise AssistantLoadError(
            f"gemma4_mtp: {type(model).__name__} is not shaped like an mlx-lm language model "
            "(model.embed_tokens and model.layers)"
        )
    args = getattr(tm, "args", None)
    n = len(layers)
    types = getattr(args, "layer_types", None)
    if types is None:
        types = [
            "sliding_attention" if getattr(_attn(layer), "is_sliding", False) else "full_attention"
            for layer in layers
        ]
    types = tuple(types)
    shared = int(getattr(args, "num_kv_shared_layers", 0) or 0)
    owning = n - shared
    donors = {}
    for i in range(owning):
        t = types[i]
        attn = _attn(layers[i])
        rope = getattr(attn, "rope", None)
        if attn is None or rope is None:
            continue
        hd = int(getattr(attn, "head_dim", 0) or 0)
        kvh = int(getattr(attn, "n_kv_heads", 0) or getattr(attn, "num_key_value_heads", 0) or 0)
        scale = float(getattr(attn, "scale", 1.0 / hd**0.5 if hd else 1.0))
        donors[t] = Donor(layer=i, rope=rope, scale=scale, kv_heads=kvh, head_dim=hd)
    check_layer_types(cfg, donors)
    hidden = int(embed.weight.shape[1]) if hasattr(embed, "weight") else None
    if hasattr(embed, "scales"):  # quantized embedding: the hidden size from the args
        hidden = int(getattr(args, "hidden_size", hidden or 0))
    vocab = int(specdec.heads.model_vocab_size(tm) or 0)
    if hidden != cfg.backbone_hidden_size:
        raise AssistantLoadError(
            f"gemma4_mtp: the assistant was made for a target of hidden size "
            f"{cfg.backbone_hidden_size} (backbone_hidden_size), this target's is {hidden}"
        )
    if vocab != cfg.vocab_size:
        raise AssistantLoadError(
            f"gemma4_mtp: the assistant's vocabulary has {cfg.vocab_size} tokens, the "
            f"target's {vocab}: they are not a pair"
        )
    window = getattr(args, "sliding_window", None)
    if "sliding_attention" in cfg.layer_types and window and window != cfg.sliding_window:
        raise AssistantLoadError(
            f"gemma4_mtp: the assistant's sliding layers attend to a window of "
            f"{cfg.sliding_window} keys, the target's sliding window is {window}"
        )
    for i, t in enumerate(cfg.layer_types):
        d = donors[t]
        hd = cfg.layer_head_dim(i)
        if d.head_dim and d.head_dim != hd:
            raise AssistantLoadError(
                f"gemma4_mtp: assistant layer {i} ({t}) has query heads of size {hd}, the "
                f"target's layer {d.layer} keys of size {d.head_dim}"
            )
        if d.kv_heads and cfg.num_attention_heads % d.kv_heads:
            raise AssistantLoadError(
                f"gemma4_mtp: assistant layer {i} ({t}) has {cfg.num_attention_heads} query "
                f"heads, not a multiple of the target's {d.kv_heads} key/value heads"
            )
    return TargetBinding(
        model=model,
        hidden_size=hidden,
        vocab_size=vocab,
        embed=embed,
        scale=embed_scale(hidden),
        donors=donors,
        layer_types=types,
    )
