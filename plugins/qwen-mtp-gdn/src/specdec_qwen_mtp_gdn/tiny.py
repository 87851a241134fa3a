"""Tiny random hybrid (attention + gated-delta-net) mlx-lm models, for tests and benchmarks.

No weights are downloaded: the models are built from mlx-lm ``ModelArgs`` with
random float32 weights.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx

#: Architectures :func:`make_tiny_hybrid` builds (mlx-lm module names).
HYBRID_ARCHITECTURES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")

#: The shared tiny config: 4 layers, 3 gated-delta-net and 1 full attention (as in
#: Qwen3-Next's 3:1 pattern); GDN heads: 2 key heads of 32, 4 value heads of 16, conv
#: kernel 4.
TINY_HYBRID_CONFIG: dict = dict(
    hidden_size=64,
    num_hidden_layers=4,
    full_attention_interval=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    num_experts=0,
    num_experts_per_tok=0,
    decoder_sparse_step=1,
    shared_expert_intermediate_size=0,
    mlp_only_layers=[],
    moe_intermediate_size=0,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    partial_rotary_factor=0.25,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)

_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def tiny_hybrid_config(arch: str = "qwen3_next", *, vocab_size: int = 64, **overrides: Any) -> dict:
    """The config dict (``config.json`` style) of a tiny model of ``arch``."""
    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny hybrid architecture {arch!r}; expected one of {HYBRID_ARCHITECTURES}"
        )
    cfg = {**TINY_HYBRID_CONFIG, "model_type": arch, "vocab_size": vocab_size}
    if arch == "qwen3_5_moe":
        cfg.update(_MOE)
    cfg.update(overrides)
    return cfg


@functools.lru_cache(maxsize=16)
def _build(
    arch: str, vocab_size: int, seed: int, sharpness: float, mixing: float, overrides: tuple
) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    cfg = tiny_hybrid_config(arch, vocab_size=vocab_size, **dict(overrides))
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    for layer in model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            # mlx-lm draws A from U(0, 16): decays of e^-10 per step make the recurrent
            # state forget a token at once. A in [0.05, 0.5] keeps several steps of
            # memory, so a wrongly rolled-back step stays visible in later logits.
            gdn.A_log = mx.log(mx.random.uniform(0.05, 0.5, gdn.A_log.shape))
            gdn.out_proj.weight = gdn.out_proj.weight * mixing
        else:
            layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * mixing
    # Random init gives near-uniform next-token distributions; a scaled head makes them
    # peaked like a real model's (as the core kit's tiny models do).
    lm = getattr(model, "language_model", model)
    lm.lm_head.weight = lm.lm_head.weight * sharpness
    mx.eval(model.parameters())
    model.eval()
    return model


def make_tiny_hybrid(
    arch: str = "qwen3_next",
    *,
    vocab_size: int = 64,
    seed: int = 1,
    sharpness: float = 8.0,
    mixing: float = 1.0,
    **overrides: Any,
) -> Any:
    """A tiny random float32 hybrid mlx-lm model (cached per arguments; do not mutate it).

    Args:
        arch: ``qwen3_next``, ``qwen3_5`` or ``qwen3_5_moe``.
        vocab_size: vocabulary size.
        seed: weight init seed.
        sharpness: scale of the output head (higher: peakier next-token distributions).
        mixing: scale of what the token-mixing layers (GDN and attention) add to the
            residual stream. Random models at 1.0 rarely repeat themselves; around 0.2
            they fall into loops of their own, so copy drafting gets partly accepted
            (the state still carries the whole history and is rolled back exactly).
        overrides: config fields to change (see :data:`TINY_HYBRID_CONFIG`).
    """
    if arch not in HYBRID_ARCHITECTURES:
        raise ValueError(
            f"unknown tiny hybrid architecture {arch!r}; expected one of {HYBRID_ARCHITECTURES}"
        )
    frozen = tuple(
        sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items())
    )
    return _build(arch, vocab_size, seed, float(sharpness), float(mixing), frozen)


def make_tiny_draft(target: Any, *, seed: int = 2) -> Any:
    """A draft model for ``target`` (a :func:`make_tiny_hybrid` model): same config with
    full attention in every layer, sharing the target's embeddings, MLPs, norms and head.

    Its caches are all ``KVCache`` (so the ``draft_model`` drafter can roll them back
    with the core's rollbacks) and its next-token choices often agree with the target's,
    so draft-model speculation gets tokens accepted.
    """
    from mlx.utils import tree_flatten

    cfg = dict(getattr(target.args, "text_config", None) or vars(target.args))
    module = importlib.import_module(f"mlx_lm.models.{target.model_type}")
    mx.random.seed(seed)
    draft = module.Model(module.ModelArgs.from_dict({**cfg, "full_attention_interval": 1}))
    own = dict(tree_flatten(draft.parameters()))
    shared = [
        (k, v) for k, v in tree_flatten(target.parameters()) if k in own and own[k].shape == v.shape
    ]
    draft.load_weights(shared, strict=False)
    draft.model.ssm_idx = None  # mlx-lm assumes layer 0 is a GDN layer
    for layer in draft.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.1
    mx.eval(draft.parameters())
    draft.eval()
    return draft


def save_tiny_hybrid(folder: str | os.PathLike, arch: str = "qwen3_next", **kwargs: Any) -> Path:
    """Write :func:`make_tiny_hybrid`'s model as an mlx-lm model folder (no tokenizer).

    ``config.json`` and ``model.safetensors``; ``mlx_lm.utils.load_model(folder)`` loads it
    back with identical weights. A benchmark that needs ``mlx_lm.load`` adds tokenizer
    files of a vocabulary of ``vocab_size`` tokens itself.

    Args:
        folder: created if missing.
        arch, kwargs: as for :func:`make_tiny_hybrid`.

    Returns:
        the folder.
    """
    from mlx.utils import tree_flatten

    model = make_tiny_hybrid(arch, **kwargs)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(getattr(model.args, "text_config", None) or vars(model.args))
    cfg["model_type"] = model.model_type
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    return out
