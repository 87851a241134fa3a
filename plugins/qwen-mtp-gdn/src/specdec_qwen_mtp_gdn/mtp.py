"""The native multi-token-prediction (MTP) head of Qwen3-Next / Qwen3.5: weights and module.

mlx-lm drops every ``mtp.*`` tensor when it loads (or converts) these models, so the
head is read from the original Hugging Face checkpoint files: sharded safetensors
with ``model.safetensors.index.json`` (only the shards that hold ``mtp.*`` keys are
opened) or a single ``model.safetensors``.

The module (checked against vLLM's ``qwen3_next_mtp.py`` / ``qwen3_5_mtp.py``,
SGLang's and mlx-vlm's; see the plugin README for where they differ)::

    e = embed_tokens(x[t+1])                 # the target's embeddings
    h = target hidden at t                   # after the target's final norm
    z = fc(concat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])    # 2H -> H
    z = layers(z)                            # the target's full-attention layer type,
                                             # own KV cache, RoPE position t
    o = norm(z)                              # next step's h; logits = lm_head(o)

All its RMSNorm weights are stored zero-centred (``w - 1``) in the checkpoint, as the
target's are; they get ``+1`` at load, the way mlx-lm's ``sanitize`` treats the
target's own norms.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import specdec
import specdec.checkpoints

#: Key prefixes under which checkpoints store the MTP head (Qwen3-Next and Qwen3.5 use
#: the top-level ``mtp.``; the others are what re-exports have been seen to write).
MTP_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp.")

#: Norm weights (relative to the head) stored zero-centred.
_NORM_KEY = re.compile(
    r"^(pre_fc_norm_embedding|pre_fc_norm_hidden|norm|"
    r"layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.q_norm|self_attn\.k_norm))"
    r"\.weight$"
)
_EXPERT_KEY = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


class MTPLoadError(specdec.ModelLoadError):
    """The MTP head cannot be found or does not fit the target (the message says why)."""


def _strip(key: str) -> str | None:
    for p in MTP_PREFIXES:
        if key.startswith(p):
            return key[len(p) :]
    return None


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MTPLoadError(f"qwen_mtp: cannot read {path}: {exc}") from exc


def _mtp_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder`` that hold MTP keys (all of them without an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise MTPLoadError(f"qwen_mtp: {index} is not a safetensors index: {exc}") from exc
        names = sorted({f for k, f in weight_map.items() if _strip(k) is not None})
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise MTPLoadError(
                f"qwen_mtp: {index} puts the MTP weights in {missing}, which "
                f"{'is' if len(missing) == 1 else 'are'} not in {folder}"
            )
        return [folder / n for n in names]
    return sorted(folder.glob("*.safetensors"))


def read_mtp_weights(source: str | Path) -> tuple[dict[str, mx.array], dict, Path]:
    """The MTP tensors of a checkpoint (keys relative to the head), its config and folder.

    Args:
        source: a checkpoint folder (with ``config.json``, safetensors files and, when
            sharded, ``model.safetensors.index.json``) or one ``.safetensors`` file.

    Raises:
        MTPLoadError: no such folder or file, or no ``mtp.*`` tensors in it (an
            mlx-lm conversion: the message says how to point at the original checkpoint).
    """
    path = Path(source).expanduser()
    if path.is_file():
        files, folder = [path], path.parent
    elif path.is_dir():
        folder = path
        files = _mtp_files(folder)
    else:
        raise MTPLoadError(
            f"qwen_mtp: mtp_path {str(path)!r} does not exist; give the folder of the "
            "original Hugging Face checkpoint (or one of its .safetensors files)"
        )
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            tensors = mx.load(str(f))
        except Exception as exc:
            raise MTPLoadError(f"qwen_mtp: cannot read {f}: {type(exc).__name__}: {exc}") from exc
        for k, v in tensors.items():
            rel = _strip(k)
            if rel is not None:
                weights[rel] = v
    if not weights:
        raise MTPLoadError(
            f"qwen_mtp: {str(path)!r} has no MTP weights (no 'mtp.*' tensors). mlx-lm drops "
            "them when it loads or converts Qwen3-Next / Qwen3.5 checkpoints, so an mlx-lm "
            "model folder never has them: set the qwen_mtp option mtp_path to the original "
            "Hugging Face checkpoint folder (with model.safetensors.index.json and its shards)"
        )
    return weights, _read_config(folder), folder


def mtp_layer_count(config: Mapping, weights: Mapping[str, Any]) -> int:
    """``mtp_num_hidden_layers`` (fallback ``num_nextn_predict_layers``; the text config of
    Qwen3.5 checkpoints first), checked against the layers present in ``weights``.

    Raises:
        MTPLoadError: the config and the weights disagree, or there is no layer.
    """
    present = sorted({int(k.split(".")[1]) for k in weights if k.startswith("layers.")})
    n = None
    for cfg in (config.get("text_config") or {}, config):
        for field in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if isinstance(cfg.get(field), int):
                n = cfg[field]
                break
        if n is not None:
            break
    if n is None:  # Qwen3-Next configs name no MTP layer count: the weights tell
        n = len(present)
    if n < 1 or present != list(range(n)):
        raise MTPLoadError(
            f"qwen_mtp: the checkpoint's config gives {n} MTP layer(s) but its mtp.* tensors "
            f"hold layers {present}; the checkpoint is incomplete or not a Qwen MTP checkpoint"
        )
    return n


def _stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert tensors (Qwen3-Next, Qwen3.5-MoE) and fused ``gate_up_proj`` (Qwen3.6)
    as mlx-lm's ``switch_mlp`` stacks."""
    out: dict[str, mx.array] = {}
    experts: dict[tuple[int, str], dict[int, mx.array]] = {}
    for k, v in weights.items():
        m = _EXPERT_KEY.match(k)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = v
            continue
        if k.endswith(".mlp.experts.gate_up_proj"):
            prefix = k[: -len("experts.gate_up_proj")]
            mid = v.shape[-2] // 2
            out[f"{prefix}switch_mlp.gate_proj.weight"] = v[..., :mid, :]
            out[f"{prefix}switch_mlp.up_proj.weight"] = v[..., mid:, :]
            continue
        if k.endswith(".mlp.experts.down_proj"):
            out[k[: -len("experts.down_proj")] + "switch_mlp.down_proj.weight"] = v
            continue
        out[k] = v
    for (layer, proj), by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise MTPLoadError(
                f"qwen_mtp: MTP layer {layer} has {proj} weights for experts {ids[:8]}..., "
                "not 0..E-1"
            )
        out[f"layers.{layer}.mlp.switch_mlp.{proj}.weight"] = mx.stack([by_expert[e] for e in ids])
    return out


def shift_norms(weights: dict[str, mx.array], mode: str | bool = "auto") -> tuple[dict, list[str]]:
    """Add 1 to the zero-centred RMSNorm weights of the head.

    Args:
        mode: ``True`` shifts every norm weight, ``False`` none, ``"auto"`` each one whose
            mean is below 0.5 (a stored ``w - 1`` sits near 0, a shifted one near 1), so
            a checkpoint re-exported with shifted norms is not shifted twice.

    Returns:
        the weights and the keys that were shifted.
    """
    shifted = []
    out = dict(weights)
    for k, v in weights.items():
        if not _NORM_KEY.match(k) or v.ndim != 1:
            continue
        if mode is True or (mode == "auto" and float(v.astype(mx.float32).mean()) < 0.5):
            out[k] = v + 1.0
            shifted.append(k)
    return out, shifted


def text_model(model: Any) -> Any:
    """The language model of ``model`` (``model.language_model`` for Qwen3.5's wrapper)."""
    return getattr(model, "language_model", model)


def _layer_class(model: Any) -> type:
    layers = getattr(model, "layers", None) or []
    full = [lyr for lyr in layers if not getattr(lyr, "is_linear", False)]
    if not full:
        raise MTPLoadError(
            f"qwen_mtp: {type(model).__module__} has no full-attention decoder layer to build "
            "the MTP layer from"
        )
    cls = type(full[0])
    while cls.__dict__.get("_specdec_tapped"):  # a core tap's subclass: the model's own class
        cls = cls.__bases__[0]
    return cls


def _mtp_args(args: Any) -> Any:
    """The target's args for a layer that is full attention (and MoE iff the model has experts)."""
    fields = {f.name for f in dataclasses.fields(args)}
    wanted = {"full_attention_interval": 1, "mlp_only_layers": [], "decoder_sparse_step": 1}
    return dataclasses.replace(args, **{k: v for k, v in wanted.items() if k in fields})


def _new_layer(cls: type, args: Any) -> Any:
    """``cls(args, 0)`` for layer classes that take a layer index (Qwen hybrids), else
    ``cls(args)`` (e.g. mlx-lm's llama ``TransformerBlock``)."""
    params = list(inspect.signature(cls.__init__).parameters)[1:]
    return cls(args, 0) if len(params) >= 2 else cls(args)


class QwenMTP(nn.Module):
    """The MTP module for a target model (built from the target's own layer class).

    Args:
        target: the mlx-lm ``qwen3_next`` / ``qwen3_5`` / ``qwen3_5_moe`` model.
        n_layers: ``mtp_num_hidden_layers``.
    """

    def __init__(self, target: Any, n_layers: int):
        super().__init__()
        args = text_model(target).args
        hidden, eps = args.hidden_size, args.rms_norm_eps
        layer_cls = _layer_class(target)
        margs = _mtp_args(args)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [_new_layer(layer_cls, margs) for _ in range(n_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """``[B, L, H]`` token embeddings and hidden states -> ``[B, L, H]`` after ``norm``."""
        from mlx_lm.models.base import create_attention_mask

        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)

    def make_cache(self) -> list:
        """One KV cache per MTP layer (its own, at the target's positions)."""
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]


#: The ``config.json`` field where ``specdec train-head`` records whose head it is.
TARGET_FIELD = specdec.checkpoints.TARGET_FIELD

#: What identifies a target for a trained head (the core's, shared by the head plugins).
target_identity = specdec.checkpoints.target_identity


def load_mtp(
    target: Any, source: str | Path, *, norm_shift: str | bool = True, dtype: Any = None
) -> tuple[QwenMTP, dict]:
    """Build and load the MTP head of ``target`` from the checkpoint at ``source``.

    Args:
        dtype: the weights' dtype (default: the target's embeddings').

    Returns:
        the module (weights in ``dtype``) and what was
        loaded: ``{"path", "layers", "tensors", "norms_shifted", "experts"}``.

    Raises:
        MTPLoadError: no MTP weights, a layer count that does not match, tensors that
            do not fit the target (naming the first few), or a target that is no
            Qwen hybrid model.
    """
    weights, config, folder = read_mtp_weights(source)
    trained_for = config.get(TARGET_FIELD)
    if isinstance(trained_for, dict):
        # the same embeddings in another precision match (one of the hashes does)
        diff = specdec.checkpoints.identity_mismatch(trained_for, target)
        if diff:
            said = ", ".join(f"{k} {a!r}, this one {b!r}" for k, (a, b) in diff.items())
            raise MTPLoadError(
                f"qwen_mtp: the head in {str(folder)!r} was trained for another model "
                f"({said}); train one for this model with specdec train-head"
            )
    n_layers = mtp_layer_count(config, weights)
    weights = _stack_experts(weights)
    # specdec train-head writes zero-centred norms, as the released checkpoints do.
    weights, shifted = shift_norms(weights, True if trained_for else norm_shift)
    module = QwenMTP(target, n_layers)
    from mlx.utils import tree_flatten

    want = dict(tree_flatten(module.parameters()))
    missing = sorted(set(want) - set(weights))
    extra = sorted(set(weights) - set(want))
    wrong = sorted(
        k for k in set(want) & set(weights) if tuple(want[k].shape) != tuple(weights[k].shape)
    )
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}")
        if extra:
            parts.append(f"unexpected {extra[:4]}")
        if wrong:
            k = wrong[0]
            parts.append(
                f"{len(wrong)} of another shape (e.g. mtp.{k}: {tuple(weights[k].shape)} in the "
                f"checkpoint, {tuple(want[k].shape)} for this model)"
            )
        raise MTPLoadError(
            f"qwen_mtp: the MTP weights in {str(folder)!r} do not fit the target model "
            f"({'; '.join(parts)}); is mtp_path the checkpoint of this very model?"
        )
    if dtype is None:  # the target's (for a quantized embedding: its scales')
        emb = text_model(target).model.embed_tokens
        dtype = (emb.scales if hasattr(emb, "scales") else emb.weight).dtype
    module.load_weights([(k, v.astype(dtype)) for k, v in weights.items()])
    mx.eval(module.parameters())
    module.eval()
    info = {
        "path": str(folder),
        "layers": n_layers,
        "tensors": len(weights),
        "norms_shifted": len(shifted),
        "experts": any(".switch_mlp." in k for k in weights),
        "trained_by_specdec": isinstance(trained_for, dict),
    }
    return module, info
