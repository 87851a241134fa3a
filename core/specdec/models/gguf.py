"""Convert a Llama-architecture GGUF file into an mlx-lm model folder in float32.

The folder holds ``model.safetensors``, ``config.json`` (``model_type: llama``),
``tokenizer.json`` (rebuilt with the ``tokenizers`` library from the GGUF's
``tokenizer.ggml.*`` vocabulary, with llama.cpp's pre-tokenizer behaviour) and
``tokenizer_config.json`` (special tokens and the chat template), so that
``mlx_lm.load(folder)`` and ``specdec.assemble(folder)`` take it as they would a
Hugging Face checkpoint.

Supported tensor types: F32, F16, BF16, Q4_0, Q4_1 and Q8_0. ``mx.load`` reads
the quantized ones as (weight, scales, biases) triplets in MLX's affine layout
with groups of 32; they are dequantized to float32 here.

llama.cpp's converter stores the rows of the Q and K projections permuted for
its interleaved ("traditional") rope; :func:`unpermute_qk` undoes that so the
weights work with mlx-lm's standard rope, exactly as a Hugging Face checkpoint.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import struct
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError

__all__ = [
    "GGML_TYPES",
    "GGUFError",
    "GGUFHeader",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "build_config",
    "build_tokenizer",
    "convert_gguf",
    "permute_qk",
    "read_gguf_header",
    "unpermute_qk",
]


class GGUFError(ModelLoadError):
    """A GGUF file is malformed or uses something this loader does not support."""


# ggml tensor types, by the number GGUF stores (ggml.h, enum ggml_type).
GGML_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}

SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GROUP_SIZE = 32

SUPPORTED_ARCHITECTURES = ("llama",)

# --------------------------------------------------------------------------- header


# GGUF metadata value types (gguf.md).
_SCALAR_FORMATS = {
    0: "<B",  # UINT8
    1: "<b",  # INT8
    2: "<H",  # UINT16
    3: "<h",  # INT16
    4: "<I",  # UINT32
    5: "<i",  # INT32
    6: "<f",  # FLOAT32
    7: "<?",  # BOOL
    10: "<Q",  # UINT64
    11: "<q",  # INT64
    12: "<d",  # FLOAT64
}
_STRING, _ARRAY = 8, 9


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    type_id: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.type_id, f"type {self.type_id}")


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


class _Reader:
    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF header (at byte {self.pos}).")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated GGUF string (at byte {self.pos}).")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.unpack("<I")
            count = self.unpack("<Q")
            if etype in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[etype]
                size = struct.calcsize(fmt)
                end = self.pos + size * count
                if end > len(self.buf):
                    raise GGUFError(f"{self.path}: truncated GGUF array (at byte {self.pos}).")
                values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos = end
                return values
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF metadata value type {vtype}.")


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor table (not the tensor data)."""
    path = Path(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GGUFError(f"cannot open GGUF file {path}: {e}") from e
    with f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFError(f"{path} is not a GGUF file (it is empty).") from e
        with buf:
            if buf[:4] != b"GGUF":
                raise GGUFError(f"{path} is not a GGUF file (no 'GGUF' magic at its start).")
            r = _Reader(buf, path)
            r.pos = 4
            version = r.unpack("<I")
            if version not in (2, 3):
                raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are).")
            n_tensors = r.unpack("<Q")
            n_kv = r.unpack("<Q")
            header = GGUFHeader(version=version)
            for _ in range(n_kv):
                key = r.string()
                vtype = r.unpack("<I")
                header.metadata[key] = r.value(vtype)
            for _ in range(n_tensors):
                name = r.string()
                n_dims = r.unpack("<I")
                shape = tuple(r.unpack("<Q") for _ in range(n_dims))
                type_id = r.unpack("<I")
                r.unpack("<Q")  # offset
                header.tensors[name] = TensorInfo(name, shape, type_id)
    return header


# --------------------------------------------------------------------------- config


def _arch(meta: Mapping[str, Any], path: Path | str = "GGUF") -> str:
    arch = meta.get("general.architecture")
    if arch is None:
        raise GGUFError(f"{path}: no 'general.architecture' in the GGUF metadata.")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not supported by specdec's GGUF loader "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)}). Convert the model to an "
            "mlx-lm folder with mlx_lm.convert and pass that folder as --model."
        )
    return arch


def _f32(x: float) -> float:
    """The shortest decimal that round-trips to the same float32 (1e-05, not 9.99e-06)."""
    import numpy as np

    return float(str(np.float32(x)))


def build_config(header: GGUFHeader, path: Path | str = "GGUF") -> dict[str, Any]:
    """The mlx-lm / Hugging Face ``config.json`` of a Llama-architecture GGUF."""
    meta = header.metadata
    arch = _arch(meta, path)

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise GGUFError(f"{path}: required metadata {full!r} is missing.")
        return default

    if get("expert_count", 0, required=False):
        raise GGUFError(
            f"{path}: mixture-of-experts Llama GGUFs (expert_count="
            f"{get('expert_count', required=False)}) are not supported."
        )
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise GGUFError(f"{path}: per-layer KV head counts are not supported.")
    head_dim = int(get("attention.key_length", hidden // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention key and value lengths differ; not supported.")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(
            f"{path}: partial rope (rope.dimension_count={rope_dim}, head dim {head_dim}) "
            "is not supported."
        )
    n_layers = int(get("block_count"))
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = get("vocab_size", len(tokens) if tokens else None)
    if "token_embd.weight" in header.tensors:
        vocab = header.tensors["token_embd.weight"].shape[-1]
    if vocab is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size.")
    tied = "output.weight" not in header.tensors
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = get("rope.scaling.type", "none", required=False)
    if scaling == "linear":
        config["rope_scaling"] = {
            "type": "linear",
            "factor": _f32(get("rope.scaling.factor", 1.0)),
        }
    elif scaling not in ("none", None):
        raise GGUFError(f"{path}: rope scaling type {scaling!r} is not supported.")
    if "rope_freqs.weight" in header.tensors:
        raise GGUFError(
            f"{path}: the GGUF carries a 'rope_freqs' tensor (Llama 3.1 style rope scaling), "
            "which this loader does not support."
        )
    for key, name in (
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ):
        if key in meta:
            config[name] = int(meta[key])
    return config


# --------------------------------------------------------------------------- weights


def permute_qk(w, n_heads: int):
    """llama.cpp's converter permutation (Hugging Face rows → GGUF rows); for tests."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w, n_heads: int):
    """Undo :func:`permute_qk`: GGUF Q/K rows → Hugging Face (standard rope) rows."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise GGUFError(f"Q/K projection with {rows} rows does not split into {n_heads} heads.")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_IGNORED = ("rope_freqs.weight",)


def _hf_name(name: str, path: Path | str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise GGUFError(
        f"{path}: tensor {name!r} is not part of a plain Llama model; this loader does not "
        "know where it goes."
    )


def _check_tensor_types(header: GGUFHeader, path: Path | str) -> None:
    bad = {
        name: info.type_name
        for name, info in header.tensors.items()
        if info.type_name not in SUPPORTED_TENSOR_TYPES
    }
    if bad:
        kinds = sorted(set(bad.values()))
        example = next(iter(bad))
        raise GGUFError(
            f"{path}: tensor type(s) {', '.join(kinds)} are not supported (for example "
            f"{example!r} is {bad[example]}); supported: {', '.join(SUPPORTED_TENSOR_TYPES)}. "
            "Use a GGUF quantized as Q4_0, Q4_1, Q8_0 or F16."
        )


def load_weights(path: str | os.PathLike, header: GGUFHeader, config: Mapping[str, Any]) -> dict:
    """Dequantized float32 weights under mlx-lm's Llama names, Q/K rows un-permuted."""
    import mlx.core as mx

    path = Path(path)
    _check_tensor_types(header, path)
    try:
        raw = mx.load(str(path))
    except Exception as e:  # mlx raises RuntimeError / ValueError on bad files
        raise GGUFError(f"{path}: mlx could not read the GGUF tensors: {e}") from e
    weights: dict[str, mx.array] = {}
    for name, info in header.tensors.items():
        if name in _IGNORED:
            continue
        hf = _hf_name(name, path)
        bits = _QUANT_BITS.get(info.type_name)
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if bits is not None:
            try:
                w, s, b = raw[name], raw[base + ".scales"], raw[base + ".biases"]
            except KeyError as e:
                raise GGUFError(f"{path}: quantized tensor {name!r} lacks its {e} part.") from e
            arr = mx.dequantize(
                w,
                s.astype(mx.float32),
                b.astype(mx.float32),
                group_size=_GROUP_SIZE,
                bits=bits,
            )
        else:
            if name not in raw:
                raise GGUFError(f"{path}: tensor {name!r} is missing from the data mlx read.")
            arr = raw[name].astype(mx.float32)
        expected = tuple(reversed(info.shape))
        if tuple(arr.shape) != expected:
            if len(info.shape) == 1 and arr.size == info.shape[0]:
                arr = arr.reshape(expected)
            else:
                raise GGUFError(
                    f"{path}: tensor {name!r} has shape {tuple(arr.shape)} after loading, "
                    f"expected {expected}."
                )
        if name.endswith("attn_q.weight"):
            arr = unpermute_qk(arr, config["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            arr = unpermute_qk(arr, config["num_key_value_heads"])
        weights[hf] = arr
        mx.eval(arr)
    n_layers = config["num_hidden_layers"]
    missing = [
        f"model.layers.{i}.{v}"
        for i in range(n_layers)
        for v in _LAYER_NAMES.values()
        if f"model.layers.{i}.{v}" not in weights
    ]
    missing += [v for k, v in _GLOBAL_NAMES.items() if k != "output.weight" and v not in weights]
    if missing:
        raise GGUFError(
            f"{path}: the GGUF lacks tensors a Llama model needs, e.g. {missing[:3]} "
            f"({len(missing)} missing)."
        )
    return weights


# --------------------------------------------------------------------------- tokenizer

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp, llm_tokenizer_bpe), keyed by
# the GGUF's ``tokenizer.ggml.pre``. Each regex splits the pieces the previous one
# left, keeping matches and the text between them, which is what a ``Split`` with
# ``behavior="isolated"`` does. llama.cpp's hand-written GPT-2 matcher also takes a
# trailing ``\s+``, written out here.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_REGEXES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "dbrx": (_LLAMA3,),
    "smaug-bpe": (_LLAMA3,),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "refact": (r"\p{N}", _GPT2),
    "command-r": (r"\p{N}", _GPT2),
    "smollm": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2),
    "exaone": (r"\p{N}", _GPT2),
    "minerva-7b": (r"\p{N}", _GPT2),
    "gpt-2": (_GPT2,),
    "gpt2": (_GPT2,),
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    "jais": (_GPT2,),
    "qwen2": (_QWEN2,),
    "stablelm2": (_QWEN2,),
    "chatglm-bpe": (_LLAMA3,),
    "deepseek-coder": (
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        r"[一-龥ࠀ-一가-퟿]+",
        r"\p{N}",
    ),
}
# GGUF pre-tokenizer names for which llama.cpp ignores merges when a whole word is a token.
_IGNORE_MERGES = {"llama-bpe", "llama3", "dbrx", "smaug-bpe"}

# llama.cpp token types (llama.h, enum llama_token_type).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6


def _added_tokens(tokens: list[str], types: list[int] | None):
    from tokenizers import AddedToken

    if not types:
        return []
    out = []
    for i, (tok, tt) in enumerate(zip(tokens, types, strict=False)):
        if tt == _TT_CONTROL:
            out.append((i, AddedToken(tok, special=True, normalized=False)))
        elif tt == _TT_USER_DEFINED:
            out.append((i, AddedToken(tok, special=False, normalized=False)))
    return out


def _post_processor(meta: Mapping[str, Any], tokens: list[str], add_bos: bool, add_eos: bool):
    from tokenizers import processors

    if not (add_bos or add_eos):
        return None
    single, pair, special = "$A", "$A $B", []
    if add_bos:
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        bos = tokens[bos_id]
        single, pair = f"{bos} {single}", f"{bos} $A {bos} $B"
        special.append((bos, bos_id))
    if add_eos:
        eos_id = int(meta["tokenizer.ggml.eos_token_id"])
        eos = tokens[eos_id]
        single, pair = f"{single} {eos}", f"{pair} {eos}"
        if (eos, eos_id) not in special:
            special.append((eos, eos_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _build_bpe(meta: Mapping[str, Any], path: Path | str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_REGEXES:
        raise GGUFError(
            f"{path}: pre-tokenizer {pre!r} is not supported (supported: "
            f"{', '.join(sorted(PRE_TOKENIZER_REGEXES))})."
        )
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{path}: malformed BPE merge {m!r}.")
        merges.append((a, b))
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        ignore_merges=pre in _IGNORE_MERGES,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    splits = [
        pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False)
        for rx in PRE_TOKENIZER_REGEXES[pre]
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _spm_merges(tokens: list[str], scores: list[float], types: list[int] | None):
    """BPE merges equivalent to SentencePiece-BPE scores: rank by the merged piece's score."""
    normal = {
        t: i
        for i, t in enumerate(tokens)
        if not types or types[i] in (_TT_NORMAL, _TT_USER_DEFINED)
    }
    ranked = []
    for piece, idx in normal.items():
        for cut in range(1, len(piece)):
            a, b = piece[:cut], piece[cut:]
            if a in normal and b in normal:
                ranked.append((-scores[idx], normal[a], normal[b], a, b))
    ranked.sort()
    return [(a, b) for *_, a, b in ranked]


def _build_spm(meta: Mapping[str, Any], path: Path | str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    if scores is None:
        raise GGUFError(f"{path}: a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores.")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    norm = [normalizers.Replace(" ", "▁")]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def build_tokenizer(meta: Mapping[str, Any], path: Path | str = "GGUF"):
    """A ``tokenizers.Tokenizer`` that tokenizes as llama.cpp does for this GGUF."""
    kind = meta.get("tokenizer.ggml.model")
    if "tokenizer.ggml.tokens" not in meta:
        raise GGUFError(f"{path}: the GGUF has no tokenizer (tokenizer.ggml.tokens).")
    if kind == "gpt2":
        tok = _build_bpe(meta, path)
        default_bos = False
    elif kind == "llama":
        tok = _build_spm(meta, path)
        default_bos = True
    else:
        raise GGUFError(
            f"{path}: tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level "
            "BPE and 'llama' SentencePiece)."
        )
    tokens = meta["tokenizer.ggml.tokens"]
    added = _added_tokens(tokens, meta.get("tokenizer.ggml.token_type"))
    if added:
        tok.add_special_tokens([a for _, a in added if a.special])
        tok.add_tokens([a for _, a in added if not a.special])
    for i, a in added:
        if tok.token_to_id(a.content) != i:
            raise GGUFError(f"{path}: special token {a.content!r} does not map back to id {i}.")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(meta, tokens, add_bos, add_eos)
    if post is not None:
        tok.post_processor = post
    return tok


def build_tokenizer_config(meta: Mapping[str, Any], config: Mapping[str, Any]) -> dict:
    tokens = meta["tokenizer.ggml.tokens"]
    kind = meta.get("tokenizer.ggml.model")

    def tok(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("bos"),
        "eos_token": tok("eos"),
        "unk_token": tok("unknown"),
        "pad_token": tok("padding"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.get("max_position_embeddings", 2048),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        out["chat_template"] = template
    return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------- convert


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model folder at ``out_dir`` (float32).

    The folder is written under a temporary name next to ``out_dir`` and renamed
    into place at the end, so a crash never leaves a half-written model behind.
    Returns ``out_dir``.
    """
    import mlx.core as mx

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise GGUFError(f"{out_dir} already exists; pass overwrite=True to replace it.")
    header = read_gguf_header(gguf_path)
    config = build_config(header, gguf_path)
    tokenizer = build_tokenizer(header.metadata, gguf_path)
    tok_config = build_tokenizer_config(header.metadata, config)
    weights = load_weights(gguf_path, header, config)
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # (not mkdtemp: its 0700 mode would stick to the final folder)
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
        )
        special_map = {
            k: tok_config[k]
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if k in tok_config
        }
        (tmp / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
        general = {
            k: v
            for k, v in header.metadata.items()
            if k.startswith("general.") and isinstance(v, str | int | float | bool)
        }
        (tmp / "specdec_source.json").write_text(
            json.dumps({"gguf": gguf_path.name, "general": general}, indent=2) + "\n"
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
