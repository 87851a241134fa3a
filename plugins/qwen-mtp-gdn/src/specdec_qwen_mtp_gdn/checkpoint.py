"""Write a model (and an MTP head) in the original Hugging Face checkpoint layout.

The inverse of mlx-lm's ``sanitize`` for ``qwen3_next``, ``qwen3_5`` and
``qwen3_5_moe``: zero-centred RMSNorm weights (``w - 1``), the conv1d weights of the
gated-delta-net layers as ``[C, 1, K]``, experts per expert (Qwen3-Next) or fused
``gate_up_proj`` (Qwen3.5-MoE), Qwen3.5's ``model.language_model.*`` prefix, and the
MTP head as top-level ``mtp.*`` tensors (per-expert for MoE heads), sharded with a
``model.safetensors.index.json``. mlx-lm loads such a folder as it loads a Hub
checkpoint (and drops ``mtp.*``); ``qwen_mtp`` reads the head from it. Used by the
tests (tiny checkpoints in the real layout) and by ``train_mtp_head``'s output.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx

_TRUNK_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_MTP_NORM = re.compile(
    r"^(pre_fc_norm_embedding|pre_fc_norm_hidden|norm|layers\.\d+\.(input_layernorm|"
    r"post_attention_layernorm|self_attn\.q_norm|self_attn\.k_norm))\.weight$"
)
_SWITCH = re.compile(r"^(.*)\.mlp\.switch_mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def _per_expert(key: str, v: mx.array, out: dict) -> bool:
    m = _SWITCH.match(key)
    if not m:
        return False
    for e in range(v.shape[0]):
        out[f"{m.group(1)}.mlp.experts.{e}.{m.group(2)}.weight"] = v[e]
    return True


def hf_trunk_weights(model: Any) -> dict[str, mx.array]:
    """The trunk's parameters of an mlx-lm ``qwen3_next`` / ``qwen3_5`` / ``qwen3_5_moe``
    model as the Hugging Face checkpoint stores them."""
    from mlx.utils import tree_flatten

    arch = model.model_type
    params = dict(tree_flatten(model.parameters()))
    if arch not in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        raise ValueError(
            f"hf_trunk_weights: no Hugging Face layout is known here for {arch!r} models "
            "(qwen3_next, qwen3_5, qwen3_5_moe); write the head alone (trunk=False)"
        )
    out: dict[str, mx.array] = {}
    fused: dict[str, dict[str, mx.array]] = {}
    for k, v in params.items():
        if "conv1d.weight" in k:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> HF [C, 1, K]
        if v.ndim == 1 and any(k.endswith(s) for s in _TRUNK_NORMS):
            v = v - 1.0
        if arch == "qwen3_next":
            if not _per_expert(k, v, out):
                out[k] = v
            continue
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        m = _SWITCH.match(k)
        if m and arch == "qwen3_5_moe":
            fused.setdefault(m.group(1), {})[m.group(2)] = v
            continue
        out[k] = v
    for prefix, p in fused.items():
        out[f"{prefix}.mlp.experts.gate_up_proj"] = mx.concatenate(
            [p["gate_proj"], p["up_proj"]], axis=-2
        )
        out[f"{prefix}.mlp.experts.down_proj"] = p["down_proj"]
    return out


def hf_mtp_weights(module: Any) -> dict[str, mx.array]:
    """An MTP module's parameters as ``mtp.*`` checkpoint tensors (zero-centred norms,
    experts per expert)."""
    from mlx.utils import tree_flatten

    out: dict[str, mx.array] = {}
    for k, v in tree_flatten(module.parameters()):
        if v.ndim == 1 and _MTP_NORM.match(k):
            v = v - 1.0
        tmp: dict[str, mx.array] = {}
        if _per_expert(k, v, tmp):
            out.update({f"mtp.{kk}": vv for kk, vv in tmp.items()})
        else:
            out[f"mtp.{k}"] = v
    return out


def hf_config(model: Any, *, mtp_layers: int | None = None, extra: dict | None = None) -> dict:
    """``config.json`` for the checkpoint (flat; ``mtp_num_hidden_layers`` when given,
    then the fields of ``extra``)."""
    args = getattr(model, "language_model", model).args
    cfg = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    cfg["model_type"] = model.model_type
    if mtp_layers is not None:
        cfg["mtp_num_hidden_layers"] = mtp_layers
    cfg.update(extra or {})
    return cfg


def save_hf_checkpoint(
    folder: str | Path,
    model: Any,
    mtp: Any = None,
    *,
    mtp_layers: int | None = None,
    trunk: bool = True,
    extra_config: dict | None = None,
) -> Path:
    """Write ``model`` (unless ``trunk=False``) and the MTP module ``mtp`` in the HF layout.

    The trunk goes to ``model-00001-of-00002.safetensors`` and the head to
    ``model-00002-of-00002.safetensors``, listed in ``model.safetensors.index.json``;
    ``config.json`` carries ``mtp_num_hidden_layers`` (``mtp_layers``, default: the
    module's layer count). Tokenizer files are not written.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[tuple[str, dict]] = []
    if trunk:
        shards.append(("trunk", hf_trunk_weights(model)))
    if mtp is not None:
        shards.append(("mtp", hf_mtp_weights(mtp)))
        if mtp_layers is None:
            mtp_layers = len(mtp.layers)
    n = len(shards)
    weight_map = {}
    for i, (_, tensors) in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{n:05d}.safetensors"
        mx.save_safetensors(str(out / name), tensors)
        weight_map.update({k: name for k in tensors})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1, sort_keys=True) + "\n"
    )
    (out / "config.json").write_text(
        json.dumps(
            hf_config(model, mtp_layers=mtp_layers, extra=extra_config), indent=1, sort_keys=True
        )
        + "\n"
    )
    return out
