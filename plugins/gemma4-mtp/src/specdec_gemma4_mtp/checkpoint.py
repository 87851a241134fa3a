"""Reading and writing Gemma 4 assistant checkpoints in the Hugging Face layout.

A checkpoint folder holds ``config.json`` (``model_type: gemma4_assistant``) and the
weights as one ``model.safetensors`` or as shards listed in
``model.safetensors.index.json``. Keys (as Google's checkpoints store them)::

    model.embed_tokens.weight                        [vocab, H]     tied output layer
    model.layers.{i}.input_layernorm.weight          [H]
    model.layers.{i}.self_attn.q_proj.weight         [heads * d_i, H]
    model.layers.{i}.self_attn.q_norm.weight         [d_i]
    model.layers.{i}.self_attn.o_proj.weight         [H, heads * d_i]
    model.layers.{i}.post_attention_layernorm.weight [H]
    model.layers.{i}.pre_feedforward_layernorm.weight [H]
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.post_feedforward_layernorm.weight [H]
    model.layers.{i}.layer_scalar                    [1]
    model.norm.weight                                [H]
    pre_projection.weight                            [H, 2 H_target]
    post_projection.weight                           [H_target, H]
    masked_embedding.centroids.weight                [num_centroids, H]   (ordered embeddings)
    masked_embedding.token_ordering                  [vocab] int64         (ordered embeddings)

Gemma 4's RMSNorm multiplies by its weight as stored (no ``1 + w``), so norms load as
they are. mlx-community's MLX conversions keep the same names (their embeddings may be
quantized: ``scales`` / ``biases`` next to the weight, with ``quantization`` in the
config), and are read the same way.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .assistant import AssistantConfig, AssistantLoadError, Gemma4Assistant

INDEX = "model.safetensors.index.json"
_IGNORED = ("lm_head.weight",)  # tied: the embeddings are the output layer


def _files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AssistantLoadError(
                f"gemma4_mtp: {index} is not a safetensors index: {exc}"
            ) from exc
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise AssistantLoadError(
                f"gemma4_mtp: {index} lists shards {missing} that are not in {folder}"
            )
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AssistantLoadError(
            f"gemma4_mtp: {folder} has no .safetensors files (a Gemma 4 assistant checkpoint "
            "has config.json and model.safetensors, or shards with model.safetensors.index.json)"
        )
    return files


def read_config(folder: str | os.PathLike) -> AssistantConfig:
    """The assistant config of a checkpoint folder.

    Raises:
        AssistantLoadError: no such folder, no ``config.json``, or not an assistant's.
    """
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise AssistantLoadError(
            f"gemma4_mtp: assistant {str(path)!r} is not a folder; give the folder of a "
            "Gemma 4 assistant checkpoint (config.json + safetensors)"
        )
    cfg_path = path / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise AssistantLoadError(f"gemma4_mtp: {path} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise AssistantLoadError(f"gemma4_mtp: cannot read {cfg_path}: {exc}") from exc
    return AssistantConfig.from_dict(raw)


def read_weights(folder: str | os.PathLike) -> dict[str, mx.array]:
    """Every tensor of the checkpoint's safetensors files, by key."""
    path = Path(folder).expanduser()
    weights: dict[str, mx.array] = {}
    for f in _files(path):
        try:
            weights.update(mx.load(str(f)))
        except Exception as exc:
            raise AssistantLoadError(
                f"gemma4_mtp: cannot read {f}: {type(exc).__name__}: {exc}"
            ) from exc
    return weights


def load_assistant(
    folder: str | os.PathLike, *, dtype: Any = None
) -> tuple[Gemma4Assistant, AssistantConfig]:
    """Build the assistant of a checkpoint folder and load its weights.

    Args:
        folder: the checkpoint folder.
        dtype: cast floating weights to this dtype (``None``: as stored).

    Raises:
        AssistantLoadError: the folder is not an assistant checkpoint, or its tensors do
            not match its config (names the missing, unexpected or misshapen keys).
    """
    cfg = read_config(folder)
    weights = read_weights(folder)
    for k in _IGNORED:
        weights.pop(k, None)
    module = Gemma4Assistant(cfg)
    q = cfg.raw.get("quantization") or cfg.raw.get("quantization_config")
    if isinstance(q, dict) and "bits" in q and any(k.endswith(".scales") for k in weights):

        def quantized(path: str, m: Any) -> bool:
            return hasattr(m, "to_quantized") and f"{path}.scales" in weights

        nn.quantize(
            module, group_size=q.get("group_size", 64), bits=q["bits"], class_predicate=quantized
        )
    if "masked_embedding.token_ordering" in weights:
        weights["masked_embedding.token_ordering"] = weights[
            "masked_embedding.token_ordering"
        ].astype(mx.int32)
    expected = dict(tree_flatten(module.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise AssistantLoadError(
            f"gemma4_mtp: the tensors of {folder} do not match its config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    bad = [
        f"{k} {tuple(weights[k].shape)} (expected {tuple(v.shape)})"
        for k, v in expected.items()
        if tuple(weights[k].shape) != tuple(v.shape)
    ]
    if bad:
        raise AssistantLoadError(
            f"gemma4_mtp: tensors of {folder} have the wrong shape for its config: {bad[:6]}"
        )
    if dtype is not None:
        weights = {
            k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()
        }
    module.load_weights(list(weights.items()))
    mx.eval(module.parameters())
    module.eval()
    return module, cfg


def save_assistant(
    folder: str | os.PathLike,
    module: Gemma4Assistant,
    *,
    shards: int = 1,
    extra_config: dict | None = None,
) -> Path:
    """Write ``module`` as a Hugging Face ``gemma4_assistant`` checkpoint folder.

    Args:
        folder: where to write (created).
        module: the assistant.
        shards: ``1``: one ``model.safetensors``; more: that many shards named as the Hub
            names them, with ``model.safetensors.index.json``.
        extra_config: keys added to ``config.json`` (e.g. what a trained assistant was
            trained for).

    Returns:
        the folder.
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(module.parameters()))
    if "masked_embedding.token_ordering" in weights:  # stored as int64, as Google's
        weights["masked_embedding.token_ordering"] = weights[
            "masked_embedding.token_ordering"
        ].astype(mx.int64)
    cfg = module.config.to_dict()
    cfg.update(extra_config or {})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    keys = sorted(weights)
    if shards <= 1:
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
        return out
    per = -(-len(keys) // shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        part = keys[s * per : (s + 1) * per]
        if not part:
            continue
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(
            str(out / name), {k: weights[k] for k in part}, metadata={"format": "pt"}
        )
        for k in part:
            weight_map[k] = name
            total += weights[k].nbytes
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    return out
