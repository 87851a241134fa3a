"""Loading a DFlash drafter from its Hugging Face checkpoint, for an mlx-lm target.

The layout (z-lab's published drafters): ``config.json`` with Qwen3 keys
(``hidden_size``, ``num_hidden_layers`` = the draft's layers, heads, ``head_dim``,
``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``vocab_size``,
``attention_bias``), ``block_size`` and ``num_target_layers`` at the top level and
``dflash_config: {mask_token_id, target_layer_ids[, block_size]}``; weights in
``*.safetensors`` (one file, or shards with ``model.safetensors.index.json``) named
``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` and ``layers.{i}.…`` (a ``model.``
prefix is accepted), without embeddings or an output layer (the target's are used).

Readers differ on where ``block_size`` lives (z-lab and mlx-vlm: the top level; SGLang:
``dflash_config`` first): here ``dflash_config`` first, then the top level, and a
checkpoint where the two disagree is refused. A pair that does not fit (hidden size,
vocabulary, layer count, a layer id past the target's layers, a mask token outside the
vocabulary) is refused after ``config.json`` and before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import specdec
import specdec.checkpoints
from specdec.heads import model_vocab_size

from .model import DFlashConfig, DFlashModel, default_layer_ids

__all__ = ["DFlashLoadError", "load_dflash", "read_config", "target_shape"]


class DFlashLoadError(specdec.ModelLoadError):
    """A DFlash checkpoint is missing, malformed, or does not fit the target."""


def target_shape(model: Any) -> tuple[int | None, int, int | None]:
    """The target's ``(hidden size, decoder layers, vocabulary size)``."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", None)
    text = getattr(args, "text_config", None)
    if hidden is None and isinstance(text, dict):
        hidden = text.get("hidden_size")
    return hidden, len(model.layers), model_vocab_size(model)


def _int(cfg: dict, key: str, where: str, *, default: Any = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise DFlashLoadError(f"{where}: {key} must be a non-negative integer, got {v!r}")
    return v


def read_config(folder: Path, target: Any) -> DFlashConfig:
    """The drafter's config from ``folder/config.json``, checked against ``target``.

    Raises:
        DFlashLoadError: no or unreadable ``config.json``, a missing or bad key, or a
            drafter that does not fit the target (naming what and the accepted values).
    """
    path = folder / "config.json"
    where = str(path)
    try:
        cfg = json.loads(path.read_text())
    except OSError as exc:
        raise DFlashLoadError(f"no DFlash config at {where}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise DFlashLoadError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise DFlashLoadError(f"{where} must hold a JSON object")
    dcfg = cfg.get("dflash_config")
    if not isinstance(dcfg, dict):
        raise DFlashLoadError(
            f"{where} has no dflash_config object: not a DFlash drafter (expected "
            '"dflash_config": {"mask_token_id": ..., "target_layer_ids": [...]})'
        )
    hidden = _int(cfg, "hidden_size", where)
    layers = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    kv = _int(cfg, "num_key_value_heads", where, default=heads)
    if cfg.get("head_dim") is None:
        cfg = {**cfg, "head_dim": hidden // heads if heads else 0}
    head_dim = _int(cfg, "head_dim", where)
    if cfg.get("rope_scaling"):
        raise DFlashLoadError(
            f"{where}: rope_scaling {cfg['rope_scaling']!r} is not supported (plain RoPE only)"
        )
    if layers < 1 or heads < 1 or kv < 1 or heads % kv or head_dim < 1:
        raise DFlashLoadError(
            f"{where}: num_hidden_layers ({layers}), num_attention_heads ({heads}), "
            f"num_key_value_heads ({kv}) and head_dim ({head_dim}) must be >= 1, the heads "
            "a multiple of the key/value heads"
        )
    sizes = {k: dcfg[k] for k in ("block_size",) if k in dcfg}
    top = cfg.get("block_size")
    if "block_size" in sizes and top is not None and top != sizes["block_size"]:
        raise DFlashLoadError(
            f"{where}: block_size is {top} at the top level but {sizes['block_size']} in "
            "dflash_config; the two must agree"
        )
    block = _int({"block_size": sizes.get("block_size", top)}, "block_size", where, default=16)
    if block < 2:
        raise DFlashLoadError(f"{where}: block_size must be >= 2, got {block}")
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise DFlashLoadError(
            f"{where}: layer_types {sorted(set(layer_types))}: only full-attention draft layers "
            "are supported (sliding-window draft layers are not)"
        )
    t_hidden, t_layers, t_vocab = target_shape(target)
    n_target = _int(cfg, "num_target_layers", where, default=t_layers)
    if n_target != t_layers:
        raise DFlashLoadError(
            f"{where}: the drafter was trained for a target of {n_target} layers "
            f"(num_target_layers); this target has {t_layers}"
        )
    ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
    if ids is None:
        ids = default_layer_ids(t_layers, layers)
    if (
        not isinstance(ids, list)
        or not ids
        or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
    ):
        raise DFlashLoadError(f"{where}: target_layer_ids must be a list of integers, got {ids!r}")
    bad = [i for i in ids if not 0 <= i < t_layers]
    if bad:
        raise DFlashLoadError(
            f"{where}: target_layer_ids {bad} are past the target's layers (0 .. {t_layers - 1})"
        )
    if t_hidden is not None and hidden != t_hidden:
        raise DFlashLoadError(
            f"{where}: hidden_size {hidden} but the target's is {t_hidden}: a DFlash drafter "
            "shares the target's embeddings and output layer, so they must be equal"
        )
    vocab = _int(cfg, "vocab_size", where, default=t_vocab)
    if t_vocab is not None and vocab != t_vocab:
        raise DFlashLoadError(
            f"{where}: vocab_size {vocab} but the target's vocabulary has {t_vocab} tokens"
        )
    mask = _int(dcfg, "mask_token_id", where)
    if mask >= vocab:
        raise DFlashLoadError(
            f"{where}: mask_token_id {mask} is outside the vocabulary (0 .. {vocab - 1})"
        )
    trained_for = cfg.get(specdec.checkpoints.TARGET_FIELD)
    if isinstance(trained_for, dict):  # a drafter from specdec train-dflash
        diff = specdec.checkpoints.identity_mismatch(trained_for, target)
        if diff:
            said = ", ".join(f"{k} {a!r}, this one {b!r}" for k, (a, b) in diff.items())
            raise DFlashLoadError(f"{where}: the drafter was trained for another model ({said})")
    theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e6))
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=_int(cfg, "intermediate_size", where),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        vocab_size=vocab,
        attention_bias=bool(cfg.get("attention_bias", False)),
        block_size=block,
        mask_token_id=mask,
        target_layer_ids=tuple(ids),
        num_target_layers=t_layers,
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DFlashLoadError(f"{index} is not a safetensors index: {exc}") from exc
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def load_dflash(folder: str | Path, target: Any) -> tuple[DFlashModel, dict]:
    """The drafter in ``folder`` for ``target``, and what was loaded.

    Raises:
        DFlashLoadError: see :func:`read_config`; no weight files; weights missing,
            unexpected or of the wrong shape (naming them).
    """
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise DFlashLoadError(f"no DFlash drafter folder at {folder}")
    config = read_config(folder, target)
    files = _weight_files(folder)
    if not files:
        raise DFlashLoadError(f"no *.safetensors weights in {folder}")
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except (OSError, ValueError, RuntimeError) as exc:
            raise DFlashLoadError(f"cannot read {f}: {exc}") from exc
        assert isinstance(loaded, dict)
        for name, w in loaded.items():
            weights[name.removeprefix("model.")] = w
    model = DFlashModel(config)
    from mlx.utils import tree_flatten

    want = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    wrong = sorted(k for k in want if k in weights and tuple(weights[k].shape) != want[k])
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:6]}{' ...' if len(extra) > 6 else ''}")
        if wrong:
            parts.append(
                "shapes differ: "
                + ", ".join(f"{k} {tuple(weights[k].shape)} != {want[k]}" for k in wrong[:4])
            )
        raise DFlashLoadError(f"the weights in {folder} do not fit its config: {'; '.join(parts)}")
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    info = {
        "path": str(folder),
        "block_size": config.block_size,
        "target_layer_ids": list(config.target_layer_ids),
        "draft_layers": config.num_hidden_layers,
        "mask_token_id": config.mask_token_id,
        "files": len(files),
    }
    return model, info
