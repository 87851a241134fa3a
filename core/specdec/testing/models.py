"""Tiny random mlx-lm models for tests (no downloads)."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import mlx.core as mx

#: The architectures the repo's parametrised tests run over (:func:`make_tiny_model` builds them).
ARCHITECTURES = ("llama", "qwen3", "gemma3")

#: Further architectures :func:`make_tiny_model` builds, kept out of :data:`ARCHITECTURES`
#: so that every test parametrised over it does not grow by a third; name them explicitly.
#: ``gemma4``: Gemma 4 text (sliding windows, KV-shared layers, per-layer inputs, softcapping).
EXTRA_ARCHITECTURES = ("gemma4",)

#: :data:`ARCHITECTURES` plus :data:`EXTRA_ARCHITECTURES`: every name :func:`make_tiny_model` accepts.
ALL_ARCHITECTURES = ARCHITECTURES + EXTRA_ARCHITECTURES

_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama": (
        "llama",
        dict(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3": (
        "qwen3",
        dict(
            model_type="qwen3",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=1024,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=10000.0,
        ),
    ),
    # Sliding window of 8 on two of three layers: it wraps within a short test.
    "gemma3": (
        "gemma3_text",
        dict(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=8,
            sliding_window_pattern=3,
            max_position_embeddings=1024,
        ),
    ),
    # Four layers, sliding (window 8, wraps in a short test) / full alternating; the last
    # two are KV-shared (no cache of their own: layer 2 reads layer 0's K/V, layer 3
    # layer 1's), so ``make_cache`` returns two caches for four layers. Per-layer inputs
    # on, final logits soft-capped at 10 (the head's raw logits go past 10). The head is
    # untied: with random weights a tied head mostly repeats the last input token.
    "gemma4": (
        "gemma4_text",
        dict(
            model_type="gemma4_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            global_head_dim=32,
            hidden_size_per_layer_input=8,
            num_kv_shared_layers=2,
            sliding_window=8,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            final_logit_softcapping=10.0,
            max_position_embeddings=1024,
            tie_word_embeddings=False,
        ),
    ),
}


def tiny_model_args(arch: str = "llama", *, vocab_size: int = 64, **overrides: Any) -> Any:
    """The mlx-lm ``ModelArgs`` of a tiny model of ``arch`` (one of :data:`ALL_ARCHITECTURES`)."""
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ALL_ARCHITECTURES}")
    module_name, cfg = _CONFIGS[arch]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    extra = {"vocab_size_per_layer_input": vocab_size} if arch == "gemma4" else {}
    cfg = {**cfg, "vocab_size": vocab_size, **extra, **overrides}
    return (
        module.ModelArgs.from_dict(cfg)
        if hasattr(module.ModelArgs, "from_dict")
        else module.ModelArgs(**cfg)
    )


@functools.lru_cache(maxsize=32)
def _build(arch: str, vocab_size: int, seed: int, sharpness: float, overrides: tuple) -> Any:
    module_name, _ = _CONFIGS[arch]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = tiny_model_args(arch, vocab_size=vocab_size, **dict(overrides))
    mx.random.seed(seed)
    model = module.Model(args)
    # Random init gives near-uniform next-token distributions; scaling the
    # output head (or the tied embeddings) makes them peaked like a real model's.
    head = getattr(model, "lm_head", None)
    if head is None or getattr(args, "tie_word_embeddings", False):
        head = model.model.embed_tokens
    head.weight = head.weight * sharpness
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_model(
    arch: str = "llama",
    *,
    vocab_size: int = 64,
    seed: int = 1,
    sharpness: float | None = None,
    **overrides: Any,
) -> Any:
    """A tiny random float32 mlx-lm model of ``arch`` (``llama``, ``qwen3``, ``gemma3``, ``gemma4``).

    Models are cached per arguments; do not mutate them.

    Args:
        arch: the architecture; ``gemma3`` has a sliding window of 8 that wraps in short
            tests; ``gemma4`` too, plus two KV-shared layers and logits soft-capped at 10.
        vocab_size: vocabulary size.
        seed: weight init seed.
        sharpness: scale of the output head (higher: peakier next-token distributions);
            default 8 for the untied llama/qwen3/gemma4 heads, 2 for gemma3's tied embeddings.
        overrides: ``ModelArgs`` fields to change.
    """
    if arch not in _CONFIGS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ALL_ARCHITECTURES}")
    if sharpness is None:
        sharpness = 2.0 if arch == "gemma3" else 8.0
    return _build(arch, vocab_size, seed, float(sharpness), tuple(sorted(overrides.items())))
