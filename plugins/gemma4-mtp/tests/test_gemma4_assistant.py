"""The assistant itself: its forward against an independent numpy implementation, the
training forward against the drafting steps, checkpoints in the Hugging Face layout, and
the checks a target/assistant pair gets before any model work."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import specdec
import specdec.checkpoints
import specdec_train
from gemma4_support import policy, target
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import make_tiny_model
from specdec_gemma4_mtp import (
    AssistantConfig,
    AssistantLoadError,
    bind_target,
    create_gemma4_mtp,
    load_assistant,
    new_assistant,
    read_config,
    save_assistant,
)
from specdec_gemma4_mtp.train import AssistantTrainer, cluster_vocabulary

# -- an independent numpy implementation of one draft step -------------------------------


def _rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, base, rotated):
    """Half-split RoPE over ``x`` ``[heads, L, d]``: pairs ``(i, i + d/2)`` rotated by
    ``pos * base^(-2i/d)`` for ``i < rotated/2`` (the others not at all)."""
    d = x.shape[-1]
    half = d // 2
    i = np.arange(half)
    inv = np.where(i < rotated // 2, base ** (-2.0 * i / d), 0.0)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_step(p, cfg, rope, emb, hid, kv, positions, masks):
    """One step over positions ``[L]``; ``p``: the assistant's weights as numpy arrays;
    ``rope[t] = (base, rotated dims)``; ``kv[t] = (K, V)`` ``[kv_heads, S, d]``;
    ``masks[t]``: ``[L, S]`` booleans (``None``: every key)."""
    w = lambda k: p[k].astype(np.float64)  # noqa: E731
    x = np.concatenate([emb, hid], -1) @ w("pre_projection.weight").T
    H = cfg.num_attention_heads
    for i, t in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}."
        y = _rms(x, w(pre + "input_layernorm.weight"))
        d = cfg.layer_head_dim(i)
        q = (y @ w(pre + "self_attn.q_proj.weight").T).reshape(len(positions), H, d)
        q = _rms(q, w(pre + "self_attn.q_norm.weight")).transpose(1, 0, 2)
        q = _rope(q, positions, *rope[t])
        K, V = (a.astype(np.float64) for a in kv[t])
        rep = H // K.shape[0]
        K, V = np.repeat(K, rep, axis=0), np.repeat(V, rep, axis=0)
        s = q @ K.transpose(0, 2, 1)  # scale 1.0
        if masks[t] is not None:
            s = np.where(masks[t][None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = a / a.sum(-1, keepdims=True)
        o = (a @ V).transpose(1, 0, 2).reshape(len(positions), H * d)
        x = x + _rms(
            o @ w(pre + "self_attn.o_proj.weight").T, w(pre + "post_attention_layernorm.weight")
        )
        m = _rms(x, w(pre + "pre_feedforward_layernorm.weight"))
        g = _gelu(m @ w(pre + "mlp.gate_proj.weight").T) * (m @ w(pre + "mlp.up_proj.weight").T)
        x = x + _rms(
            g @ w(pre + "mlp.down_proj.weight").T, w(pre + "post_feedforward_layernorm.weight")
        )
        x = x * w(pre + "layer_scalar")
    n = _rms(x, w("model.norm.weight"))
    return n, n @ w("post_projection.weight").T


def _np_logits(p, cfg, n):
    E = p["model.embed_tokens.weight"].astype(np.float64)
    if not cfg.use_ordered_embeddings:
        return n @ E.T
    scores = n @ p["masked_embedding.centroids.weight"].astype(np.float64).T
    table = p["masked_embedding.token_ordering"].reshape(cfg.num_centroids, -1)
    out = np.full((n.shape[0], cfg.vocab_size), -np.inf)
    for r in range(n.shape[0]):
        best = np.argsort(-scores[r])[: cfg.centroid_intermediate_top_k]
        ids = table[best].reshape(-1)
        out[r, ids] = E[ids] @ n[r]
    return out


# The tiny gemma4's rope_parameters (mlx-lm's defaults): sliding layers rotate every pair
# at theta 1e4, full layers a quarter of the pairs ("proportional") at theta 1e6.
ROPE = {"sliding_attention": (1e4, 32), "full_attention": (1e6, 8)}


@pytest.mark.parametrize("centroids", [0, 8])
def test_a_draft_step_matches_an_independent_numpy_reference(centroids):
    model = target("gemma4")
    module, binding = new_assistant(
        model,
        layers=["sliding_attention", "sliding_attention", "full_attention"],
        hidden_size=48,
        heads=2,
        centroids=centroids,
        top_k_centroids=3,
        seed=4,
    )
    # random weights everywhere (also the residual branches new_assistant starts small)
    mx.random.seed(5)
    params = tree_flatten(module.parameters())
    module.load_weights(
        [
            (k, v if k == "masked_embedding.token_ordering" else mx.random.normal(v.shape) * 0.3)
            for k, v in params
        ]
    )
    p = {k: np.asarray(v) for k, v in tree_flatten(module.parameters())}
    cfg = module.config
    tokens = list(range(3, 23))  # 20 tokens: the sliding window (8) has wrapped
    caches = make_prompt_cache(model)
    taps = specdec.capture.model_taps(model)
    with taps.recording() as rec:
        model(mx.array(tokens[:-1])[None], cache=caches)
    h = rec["hidden"][0, -1:]
    kv = binding.kv(caches, cfg.layer_types)
    assert kv["sliding_attention"][0].shape[2] == 8  # the window's last 8 keys
    assert kv["full_attention"][0].shape[2] == len(tokens) - 1
    pos = len(tokens) - 1
    emb = binding.embed_tokens(mx.array(tokens[-1:]))
    ropes = {t: d.rope for t, d in binding.donors.items()}
    scales = {t: d.scale for t, d in binding.donors.items()}
    assert scales == {"sliding_attention": 1.0, "full_attention": 1.0}
    n, nxt = module.hidden(emb[None], h[None], kv, ropes, pos, scales)
    logits = module.logits(n[0])
    np_kv = {t: (np.asarray(k[0]), np.asarray(v[0])) for t, (k, v) in kv.items()}
    rn, rnxt = _np_step(
        p, cfg, ROPE, np.asarray(emb), np.asarray(h), np_kv, [pos], {t: None for t in ROPE}
    )
    np.testing.assert_allclose(np.asarray(n[0]), rn, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(nxt[0]), rnxt, atol=2e-4, rtol=2e-4)
    ref = _np_logits(p, cfg, rn)
    got = np.asarray(logits)
    assert np.array_equal(np.isinf(got), np.isinf(ref))
    np.testing.assert_allclose(got[~np.isinf(got)], ref[~np.isinf(ref)], atol=5e-4, rtol=5e-4)
    if centroids:
        assert np.isinf(got).sum() == 64 - 3 * 8  # only the 3 best clusters' 8 tokens each
        # many rows at once (a training run's evaluation) take the whole head and a mask:
        # the same candidates, the same logits
        many = np.asarray(module.logits(mx.concatenate([n[0]] * 6)))
        for row in many:
            assert np.array_equal(np.isinf(row), np.isinf(got[0]))
            np.testing.assert_allclose(row[~np.isinf(row)], got[0][~np.isinf(got[0])], atol=1e-5)


def test_the_training_forward_is_the_drafting_step_position_by_position():
    model = target("gemma4")
    module, binding = new_assistant(model, layers=["sliding_attention", "full_attention"], seed=2)
    seq = [int(t) for t in np.random.default_rng(0).integers(0, 64, 22)]
    rec = specdec_train.record(model, seq, kv_layers=(0, 1))
    for position in ("bonus", "last"):
        trainer = AssistantTrainer(module, binding, position=position)
        ex = trainer.example(model, seq, rec)
        batch = {k: v[None] for k, v in ex.items()}
        n_all = trainer.forward(module, batch)[0]
        # position t drafting: the target has fed seq[:t+1]; the token is seq[t+1]
        for t in (0, 5, 12, len(seq) - 3):
            caches = make_prompt_cache(model)
            model(mx.array(seq[: t + 1])[None], cache=caches)
            kv = binding.kv(caches, module.config.layer_types)
            p = t + 1 if position == "bonus" else t
            n, _ = module.hidden(
                binding.embed_tokens(mx.array([seq[t + 1]]))[None],
                rec.hidden[t : t + 1][None],
                kv,
                {k: d.rope for k, d in binding.donors.items()},
                p,
                {k: d.scale for k, d in binding.donors.items()},
            )
            np.testing.assert_allclose(np.asarray(n[0, 0]), np.asarray(n_all[t]), atol=2e-4)


def test_balanced_clusters_cover_the_vocabulary_once():
    e = mx.random.normal((96, 16))
    order = cluster_vocabulary(e, 12, seed=1)
    assert sorted(order.tolist()) == list(range(96))
    with pytest.raises(ValueError, match="equal clusters"):
        cluster_vocabulary(e, 7)


# -- checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 3])
def test_checkpoints_in_the_hf_layout_load_back(tmp_path, shards):
    model = target("gemma4")
    module, _ = new_assistant(
        model, layers=["sliding_attention", "full_attention"], centroids=8, top_k_centroids=2
    )
    folder = save_assistant(tmp_path / "a", module, shards=shards)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant" and cfg["backbone_hidden_size"] == 64
    assert cfg["text_config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["use_ordered_embeddings"] is True and cfg["num_centroids"] == 8
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if shards > 1:
        assert files == [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        keys = set(index["weight_map"])
    else:
        assert files == ["model.safetensors"]
        keys = set(mx.load(str(folder / "model.safetensors")))
    assert {
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.1.layer_scalar",
        "model.norm.weight",
        "pre_projection.weight",
        "post_projection.weight",
        "masked_embedding.centroids.weight",
        "masked_embedding.token_ordering",
    } <= keys
    assert not any("k_proj" in k or "v_proj" in k for k in keys)  # the target's K/V only
    stored = {}
    for f in folder.glob("*.safetensors"):
        stored.update(mx.load(str(f)))
    assert stored["masked_embedding.token_ordering"].dtype == mx.int64  # as Google stores it
    loaded, lcfg = load_assistant(folder)
    assert lcfg.layer_types == ("sliding_attention", "full_attention")
    a = dict(tree_flatten(module.parameters()))
    for k, v in tree_flatten(loaded.parameters()):
        assert np.array_equal(np.asarray(v), np.asarray(a[k])), k


def test_bad_checkpoints_say_what_is_wrong(tmp_path):
    model = target("gemma4")
    module, _ = new_assistant(model, layers=["full_attention"])
    folder = save_assistant(tmp_path / "a", module)
    cfg = json.loads((folder / "config.json").read_text())
    with pytest.raises(AssistantLoadError, match="is not a folder"):
        read_config(tmp_path / "nothing")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**cfg, "model_type": "gemma4_text"}))
    with pytest.raises(AssistantLoadError, match="model_type 'gemma4_text'.*gemma4_assistant"):
        read_config(wrong)
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AssistantLoadError, match="no .safetensors files"):
        load_assistant(wrong)
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["pre_projection.weight"]
    mx.save_safetensors(str(wrong / "model.safetensors"), weights)
    with pytest.raises(AssistantLoadError, match="missing \\['pre_projection.weight'\\]"):
        load_assistant(wrong)
    weights = mx.load(str(folder / "model.safetensors"))
    weights["post_projection.weight"] = weights["post_projection.weight"][:, :5]
    mx.save_safetensors(str(wrong / "model.safetensors"), weights)
    with pytest.raises(AssistantLoadError, match="wrong shape.*post_projection"):
        load_assistant(wrong)


def _config(**text):
    base = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "layer_types": ["full_attention"],
        "num_attention_heads": 2,
        "head_dim": 32,
        "global_head_dim": 32,
        "vocab_size": 64,
    }
    base.update(text)
    return AssistantConfig.from_dict(
        {"model_type": "gemma4_assistant", "backbone_hidden_size": 64, "text_config": base}
    )


def test_a_pair_that_does_not_match_is_refused_before_any_model_work(tmp_path):
    model = target("gemma4")
    bind_target(model, _config())  # a pair
    with pytest.raises(AssistantLoadError, match="vocabulary has 128 tokens.*64"):
        bind_target(model, _config(vocab_size=128))
    cfg = AssistantConfig.from_dict({**_config().to_dict(), "backbone_hidden_size": 96})
    with pytest.raises(AssistantLoadError, match="hidden size 96.*this target's is 64"):
        bind_target(model, cfg)
    with pytest.raises(AssistantLoadError, match="query heads of size 16.*keys of size 32"):
        bind_target(model, _config(head_dim=16, global_head_dim=16))
    with pytest.raises(
        AssistantLoadError, match="sliding_attention.*target's layers are \\['full_attention'\\]"
    ):
        bind_target(target("llama"), _config(layer_types=["sliding_attention"]))
    # through the pipeline: refused at assemble, before the assistant's weights are read
    module, _ = new_assistant(target("llama"), layers=["full_attention"])
    folder = save_assistant(tmp_path / "llama", module)
    (folder / "model.safetensors").write_bytes(b"not read")
    with pytest.raises(AssistantLoadError, match="query heads of size 16"):
        specdec.assemble(model, policy=policy(folder))


def test_an_assistant_trained_for_another_model_is_refused(tmp_path):
    model = target("gemma4")
    module, _ = new_assistant(model, layers=["full_attention"])
    other = make_tiny_model("gemma4", seed=3)  # same shapes, other weights
    folder = save_assistant(
        tmp_path / "a",
        module,
        extra_config={specdec.checkpoints.TARGET_FIELD: specdec.checkpoints.target_identity(other)},
    )
    with pytest.raises(AssistantLoadError, match="trained for another model"):
        specdec.assemble(model, policy=policy(folder))


def test_options_are_checked_before_any_model_work():
    with pytest.raises(specdec.PolicyError, match="option assistant is required"):
        create_gemma4_mtp()
    for bad, match in (
        ({"position": "middle"}, "position must be one of"),
        ({"centroids": "maybe"}, "centroids must be"),
        ({"depth": 0}, "depth"),
        ({"depth": 4, "max_depth": 2}, "max_depth .2. must be >= depth .4."),
        ({"sampled_drafts": "x"}, "sampled_drafts"),
        ({"colour": 1}, "colour"),
    ):
        with pytest.raises(specdec.PolicyError, match=match):
            create_gemma4_mtp(assistant="x", **bad)
    # It reads the target's hidden states and K/V: the logits verifier is refused.
    with pytest.raises(specdec.PolicyError, match="needs 'hidden'"):
        specdec.assemble(
            target("gemma4"),
            policy={"drafters": ["gemma4_mtp"], "options": {"gemma4_mtp": {"assistant": "x"}}},
        )


@pytest.mark.parametrize("name", ["gemma4", "gemma4-k-eq-v"])
def test_the_target_side_gives_the_stock_logits_the_last_hidden_state_and_the_shared_kv(name):
    """The hidden verifier's logits are the stock model's (soft-capping included), its
    hidden state is the backbone's output, and the K/V the assistant reads are, per layer
    type, those the target's own KV-shared layers attend to."""
    model = target(name)
    module, binding = new_assistant(model, layers=["sliding_attention", "full_attention"])
    tokens = mx.array(list(range(5, 25)))
    v = specdec.verifiers.HiddenStateVerifier()
    v.bind(model)
    caches = make_prompt_cache(model)
    got = v.verify(model, tokens, caches)
    ref = model(tokens[None], cache=make_prompt_cache(model))[0]
    assert np.array_equal(np.asarray(got.logits), np.asarray(ref.astype(mx.float32)))
    assert float(mx.abs(ref).max()) <= 10.0  # soft-capped at 10
    np.testing.assert_array_equal(np.asarray(got.hidden), np.asarray(model.model(tokens[None])[0]))
    # the donors are the layers the shared layers (2: sliding, 3: full) read from
    shared = model.model.previous_kvs
    assert binding.donors["sliding_attention"].layer == shared[2] == 0
    assert binding.donors["full_attention"].layer == shared[3] == 1
    assert len(caches) == 2  # only the owning layers have caches
    kv = binding.kv(caches, ("sliding_attention", "full_attention"))
    assert kv["full_attention"][0].shape[2] == 20 and kv["sliding_attention"][0].shape[2] == 8
    if name == "gemma4-k-eq-v":  # values from the key projection, v_norm'ed: not the keys
        assert model.model.layers[1].self_attn.use_k_eq_v
        k, val = kv["full_attention"]
        assert not np.allclose(np.asarray(k), np.asarray(val))
