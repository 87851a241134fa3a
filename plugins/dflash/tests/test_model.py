"""The DFlash draft forward against an independent numpy reference, and loading
published-layout checkpoints for a target (refusing pairs that do not fit before any
weight is read)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from dflash_support import tiny_config, write_checkpoint
from mlx.utils import tree_flatten
from specdec.testing import make_tiny_model
from specdec_dflash.checkpoint import DFlashLoadError, load_dflash
from specdec_dflash.model import default_layer_ids


@pytest.fixture(scope="module")
def qwen3():
    return make_tiny_model("qwen3")


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


# -- an independent reference ----------------------------------------------------------


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, base):
    """NeoX-style rotation of ``x`` ``[heads, T, d]`` at ``positions``."""
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / d)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None]
    cos, sin = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _reference(w: dict, cfg: dict, features: np.ndarray, block: np.ndarray, start: int):
    """The block's final hidden states: ``features`` [T, k*H] at positions 0..T-1, the
    block's embeddings [B, H] at ``start``.."""
    eps, base = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = _rms(features @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    t, b = ctx.shape[0], block.shape[0]
    x = block
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        xn = _rms(x, w[p + "input_layernorm.weight"], eps)

        def heads(y, n):
            return y.reshape(y.shape[0], n, hd).transpose(1, 0, 2)

        q = _rms(
            heads(xn @ w[p + "self_attn.q_proj.weight"].T, nh),
            w[p + "self_attn.q_norm.weight"],
            eps,
        )
        q = _rope(q, range(start, start + b), base)
        keys, values = [], []
        for src, pos in ((ctx, range(t)), (xn, range(start, start + b))):
            k = heads(src @ w[p + "self_attn.k_proj.weight"].T, nkv)
            k = _rope(_rms(k, w[p + "self_attn.k_norm.weight"], eps), pos, base)
            keys.append(k)
            values.append(heads(src @ w[p + "self_attn.v_proj.weight"].T, nkv))
        k, v = np.concatenate(keys, axis=1), np.concatenate(values, axis=1)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v  # [heads, B, hd], no mask
        x = x + a.transpose(1, 0, 2).reshape(b, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)


@pytest.mark.parametrize("parts", [1, 3])
def test_draft_forward_matches_a_numpy_reference(qwen3, tmp_path, parts):
    cfg = tiny_config(qwen3, layers=2, ids=(0, 1), block=6)
    write_checkpoint(tmp_path, cfg, seed=1)
    model, info = load_dflash(tmp_path, qwen3)
    assert info["target_layer_ids"] == [0, 1] and info["block_size"] == 6
    w = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(model.parameters())}
    rng = np.random.default_rng(0)
    hidden = cfg["hidden_size"]
    t, b = 11, cfg["block_size"]
    feats = rng.normal(size=(t, 2 * hidden)).astype(np.float32)
    block = rng.normal(size=(b, hidden)).astype(np.float32)
    caches = model.make_cache()
    # the context appended in parts (as rounds commit it) or at once: the same cache
    cuts = np.linspace(0, t, parts + 1).astype(int)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        model.append_context(mx.array(feats[lo:hi])[None], int(lo), caches)
    out = model(mx.array(block)[None], t, caches)
    ref = _reference(w, cfg, feats.astype(np.float64), block.astype(np.float64), t)
    np.testing.assert_allclose(np.array(out[0]), ref, rtol=2e-4, atol=2e-4)
    assert all(c.offset == t for c in caches)  # the block was not written


def test_default_layer_ids_follow_the_published_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_layer_ids(52, 5) == [1, 13, 25, 37, 49]
    assert default_layer_ids(28, 1) == [14]


# -- loading ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("layout", ["single", "prefixed", "sharded"])
def test_checkpoints_in_the_published_layout_load(arch, layout, tmp_path, request):
    target = request.getfixturevalue(arch)
    cfg = tiny_config(target, ids=(1, 0))
    written = write_checkpoint(
        tmp_path,
        cfg,
        prefix="model." if layout == "prefixed" else "",
        shards=3 if layout == "sharded" else 1,
    )
    model, info = load_dflash(tmp_path, target)
    got = dict(tree_flatten(model.parameters()))
    for name, v in tree_flatten(written.parameters()):
        assert mx.array_equal(got[name], v), name
    assert info["files"] == (3 if layout == "sharded" else 1)


def _refused(tmp_path, target, match, **edits):
    cfg = tiny_config(target)
    for key, value in edits.items():
        if key.startswith("dflash_"):
            cfg["dflash_config"][key[7:]] = value
        elif value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # weights that cannot be read: the refusal must come from config.json, before them
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(DFlashLoadError, match=match):
        load_dflash(tmp_path, target)


@pytest.mark.parametrize(
    "edits, match",
    [
        ({"hidden_size": 128}, "hidden_size 128 but the target's is 64"),
        ({"vocab_size": 999}, "vocab_size 999 but the target's vocabulary has"),
        ({"num_target_layers": 36}, "trained for a target of 36 layers"),
        ({"dflash_target_layer_ids": [0, 5]}, r"target_layer_ids \[5\] are past the target's"),
        ({"dflash_target_layer_ids": "0,1"}, "target_layer_ids must be a list of integers"),
        ({"dflash_mask_token_id": 10_000}, "mask_token_id 10000 is outside the vocabulary"),
        ({"dflash_block_size": 4}, "block_size is 8 at the top level but 4 in dflash_config"),
        ({"block_size": 1}, "block_size must be >= 2"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "only full-attention"),
        ({"num_attention_heads": 3}, "a multiple of the key/value heads"),
    ],
)
def test_a_pair_that_does_not_fit_is_refused_before_weights_are_read(qwen3, tmp_path, edits, match):
    _refused(tmp_path, qwen3, match, **edits)


def test_not_a_dflash_checkpoint_and_bad_weights_are_named(qwen3, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(DFlashLoadError, match="no dflash_config object"):
        load_dflash(tmp_path / "a", qwen3)
    with pytest.raises(DFlashLoadError, match="no DFlash drafter folder"):
        load_dflash(tmp_path / "missing", qwen3)
    cfg = tiny_config(qwen3)
    write_checkpoint(tmp_path / "b", cfg)
    cfg["num_hidden_layers"] = 3  # the weights hold 2
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashLoadError, match=r"missing \['layers\.2\."):
        load_dflash(tmp_path / "b", qwen3)
    cfg["num_hidden_layers"] = 2
    cfg["intermediate_size"] = 100
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashLoadError, match="shapes differ"):
        load_dflash(tmp_path / "b", qwen3)


def test_the_training_forward_is_the_drafting_forward(qwen3, tmp_path):
    """Blocks of the training forward (many anchors at once, their RoPE offsets an array,
    the context masked to the positions before each anchor) equal the drafting forward of
    a context cache holding the features before that anchor."""
    from specdec_dflash.drafter import embeddings

    cfg = tiny_config(qwen3, ids=(0, 1), block=5)
    write_checkpoint(tmp_path, cfg, seed=4)
    model, _ = load_dflash(tmp_path, qwen3)
    rng = np.random.default_rng(1)
    S, B = 14, cfg["block_size"]
    feats = mx.array(rng.normal(size=(S, 2 * cfg["hidden_size"])).astype(np.float32))
    tokens = mx.array(rng.integers(0, cfg["vocab_size"], size=S))
    anchors = [2, 7, 12]
    embed = embeddings(qwen3)
    p = mx.array(anchors)
    ids = mx.where(
        mx.arange(B)[None] == 0, tokens[p][:, None], cfg["dflash_config"]["mask_token_id"]
    )
    ok = mx.arange(S)[None] < p[:, None]
    mask = mx.concatenate([ok, mx.ones((len(anchors), B), dtype=mx.bool_)], axis=1)
    mask = mx.broadcast_to(mask[:, None, None, :], (len(anchors), 1, B, S + B))
    batched = model.forward(embed(ids), p, model.context(feats[None], 0), mask)
    for row, a in enumerate(anchors):
        caches = model.make_cache()
        model.append_context(feats[None, :a], 0, caches)
        alone = model(embed(ids[row])[None], a, caches)[0]
        np.testing.assert_allclose(np.array(batched[row]), np.array(alone), atol=2e-5)


def test_the_step_cost_measurement_times_each_block_against_a_target_step(qwen3, tmp_path):
    """``python -m specdec_dflash costs``' measurement: one median per block size and the
    target step, interleaved (what it reports, not how fast anything is)."""
    from specdec_dflash.costs import measure_step_costs

    write_checkpoint(tmp_path, tiny_config(qwen3, ids=(0, 1), block=8))
    module, _ = load_dflash(tmp_path, qwen3)
    res = measure_step_costs(qwen3, module, context=24, blocks=(4, 8, 16), reps=2)
    assert set(res["ms"]) == {"target_step", "draft_block_4", "draft_block_8", "draft_block_16"}
    assert all(v > 0 for v in res["ms"].values())
    assert res["fraction_of_target_step"]["target_step"] == 1.0
    assert (res["context"], res["reps"], res["draft_layers"]) == (24, 2, 2)
