"""The qwen_mtp drafter: loading native MTP heads from HF-layout checkpoints, drafting,
exactness (greedy identity, sampled distribution), composition with ngram_copy, depth."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import specdec
from gdn_support import copy_prompt
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from specdec.testing import (
    FAULTS,
    check_batch_identity,
    check_drafter_faults,
    check_greedy_identity,
    check_sampled_distribution,
    check_sampled_identity,
    plain_greedy,
    plugin_host,
)
from specdec.testing import greedy_sequences as sequences
from specdec_qwen_mtp_gdn.checkpoint import save_hf_checkpoint
from specdec_qwen_mtp_gdn.mtp import MTPLoadError, QwenMTP, load_mtp
from specdec_qwen_mtp_gdn.mtp_drafter import (
    DEFAULTS,
    QwenMTPDrafter,
    create_qwen_mtp,
)
from specdec_qwen_mtp_gdn.tiny import make_tiny_hybrid
from specdec_qwen_mtp_gdn.train import target_hidden, train_mtp_head

MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
#: qwen3_next with experts (mlx-lm converts a Qwen3-Next checkpoint only when it has
#: per-expert weights, as every real one does), dense qwen3_5, and qwen3_5_moe (fused experts).
KINDS = {"qwen3_next": MOE, "qwen3_5": {}, "qwen3_5_moe": {}}


def tiny(arch):
    return make_tiny_hybrid(arch, mixing=0.2, seed=0, **KINDS[arch])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``{arch: (model loaded back by mlx-lm, checkpoint folder, training sequences)}``: a
    head trained on the tiny model's own text, written with the trunk in the HF layout."""
    cache = {}

    def get(arch):
        if arch not in cache:
            model = tiny(arch)
            seqs = sequences(model)
            if arch == "qwen3_5":  # also the text of the composition test
                cp = list(copy_prompt(arch))
                seqs.append(cp + plain_greedy(model, cp, 32))
            head, st = train_mtp_head(model, seqs, steps=150)
            assert st["last_loss"] < st["first_loss"] / 4 and st["top1"] > 0.8, st
            folder = save_hf_checkpoint(tmp_path_factory.mktemp(arch), model, head)
            loaded, _ = mlx_load_model(folder)
            specdec.loading.set_model_source(loaded, folder)
            cache[arch] = (loaded, folder, seqs)
        return cache[arch]

    return get


MTP = specdec.load_policy("mtp")


# -- checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(KINDS))
def test_hf_layout_checkpoint_loads_in_mlx_lm_and_keeps_the_head(tmp_path, arch):
    model = tiny(arch)
    mx.random.seed(3)
    head = QwenMTP(model, 1)
    folder = save_hf_checkpoint(tmp_path, model, head)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    mtp_keys = [k for k in index if k.startswith("mtp.")]
    assert "mtp.fc.weight" in mtp_keys and "mtp.pre_fc_norm_hidden.weight" in mtp_keys
    if arch != "qwen3_5":
        assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in mtp_keys  # per expert
    if arch == "qwen3_5_moe":
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in index)  # fused trunk
    stored = mx.load(str(folder / index["mtp.norm.weight"]))["mtp.norm.weight"]
    assert float(mx.abs(stored).max()) < 1e-6  # zero-centred (a fresh norm is all ones)
    loaded, _ = mlx_load_model(folder)  # mlx-lm's own sanitize: drops mtp.*
    assert not any("mtp" in k for k, _ in tree_flatten(loaded.parameters()))
    x = mx.array([[1, 2, 3, 4, 5, 6]])
    assert mx.array_equal(loaded(x), model(x))
    module, info = load_mtp(loaded, folder)
    assert info["layers"] == 1 and info["norms_shifted"] == 7
    assert info["experts"] == (arch != "qwen3_5")
    want = dict(tree_flatten(head.parameters()))
    for k, v in tree_flatten(module.parameters()):
        assert mx.array_equal(v, want[k]), k


def test_a_folder_without_mtp_weights_says_what_to_do(tmp_path):
    model = tiny("qwen3_5")
    save_hf_checkpoint(tmp_path, model)  # the trunk only, as mlx-lm conversions are
    with pytest.raises(MTPLoadError, match="no MTP weights.*mlx-lm drops them.*mtp_path"):
        load_mtp(model, tmp_path)
    with pytest.raises(MTPLoadError, match="does not exist"):
        load_mtp(model, tmp_path / "nope")
    pipe_model, _ = mlx_load_model(tmp_path)
    with pytest.raises(MTPLoadError, match="no MTP weights"):
        specdec.assemble(pipe_model, policy=MTP.with_options("qwen_mtp", mtp_path=str(tmp_path)))
    with pytest.raises(MTPLoadError, match="not loaded from a local folder"):
        specdec.assemble(tiny("qwen3_5"), policy=MTP)


def test_weights_of_another_model_or_layer_count_are_refused(tmp_path):
    small = tiny("qwen3_5")
    other = make_tiny_hybrid("qwen3_5", hidden_size=32, head_dim=8, seed=0)
    save_hf_checkpoint(tmp_path / "other", other, QwenMTP(other, 1))
    with pytest.raises(MTPLoadError, match="do not fit the target.*mtp.fc.weight"):
        load_mtp(small, tmp_path / "other")
    save_hf_checkpoint(tmp_path / "two", small, QwenMTP(small, 1), mtp_layers=2)
    with pytest.raises(MTPLoadError, match="2 MTP layer.*layers \\[0\\]"):
        load_mtp(small, tmp_path / "two")


def test_a_trained_head_loads_for_its_model_in_another_precision(tmp_path):
    from specdec_qwen_mtp_gdn.mtp import TARGET_FIELD, target_identity

    model = tiny("qwen3_5")
    folder = save_hf_checkpoint(
        tmp_path / "head",
        model,
        QwenMTP(model, 1),
        extra_config={TARGET_FIELD: target_identity(model)},
    )
    for dt in (mx.bfloat16, mx.float16):
        cast, _ = mlx_load_model(folder)  # the same weights (a fresh copy), then cast
        cast.set_dtype(dt)
        assert target_identity(cast)["embed_sha256"] != target_identity(model)["embed_sha256"]
        _, info = load_mtp(cast, folder)  # the rounded hash of the embeddings matches
        assert info["trained_by_specdec"]
    other = make_tiny_hybrid("qwen3_5", mixing=0.2, seed=5)
    with pytest.raises(MTPLoadError, match="trained for another model.*embed_sha256"):
        load_mtp(other, folder)


def test_options_are_checked_before_any_model_work():
    assert set(DEFAULTS) >= {"mtp_path", "depth", "max_depth", "adaptive", "head"}
    with pytest.raises(specdec.PolicyError, match="unknown option.*accepted options"):
        create_qwen_mtp(depht=2)
    with pytest.raises(specdec.PolicyError, match="max_depth .* must be >= depth"):
        create_qwen_mtp(depth=4, max_depth=2)
    with pytest.raises(specdec.PolicyError, match="depth must be an integer >= 1"):
        create_qwen_mtp(depth=0)
    with pytest.raises(specdec.PolicyError, match="norm_shift"):
        create_qwen_mtp(norm_shift="yes")
    # The head reads hidden states: a policy without the hidden verifier is refused.
    with pytest.raises(specdec.PolicyError, match="needs 'hidden'.*verifier = 'hidden'"):
        specdec.assemble(tiny("qwen3_5"), policy={"drafters": ["qwen_mtp"]})


# -- drafting -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", sorted(KINDS))
def test_greedy_identity_with_drafts_accepted(trained, arch):
    model, folder, seqs = trained(arch)
    prompt = seqs[0][:8]
    # max_tokens 1..16 and 40, and with a stop token inside an accepted block.
    totals = check_greedy_identity(model, MTP, prompt, max_tokens_list=(*range(1, 17), 40))
    assert totals["accepted"] > 0
    pipe = specdec.assemble(model, policy=MTP)
    rounds = []
    out = pipe.generate(prompt, max_tokens=40, on_round=lambda r, c: rounds.append(r))
    # Primed on the prompt's hidden states in prefill: the first round drafts already.
    assert rounds[0].drafter == "qwen_mtp" and len(rounds[0].block) == DEFAULTS["depth"]
    st = out.stats.per_drafter["qwen_mtp"]
    assert st["mtp"]["path"] == str(folder)
    assert st["position_acceptance"][0] > 0.8  # the trained text: position 1 is right
    assert st["position_reached"][0] == st["mtp_rounds"] and st["hidden_gaps"] == 0
    assert out.stats.tokens_per_forward > 1.5


def test_a_faulty_mtp_drafter_ends_in_a_named_error_or_identical_output(trained):
    # the kit's fault check: out-of-range ids (lazy ones too), bad q, exceptions
    model, _, seqs = trained("qwen3_5")
    outcomes = check_drafter_faults(model, MTP, seqs[0][:8], max_tokens=16)
    assert {o.fault for o in outcomes} == set(FAULTS)


def test_a_conversation_continued_from_its_prompt_cache(trained):
    # Turn 2 starts from the cache turn 1 left: only the new tokens are prefilled, the
    # head's own cache starts at the first of them, and it still drafts and is accepted.
    from mlx_lm.models.cache import make_prompt_cache

    model, _, seqs = trained("qwen3_5")
    pipe = specdec.assemble(model, policy=MTP)
    plain = specdec.assemble(model, policy="none")
    cache = make_prompt_cache(model)
    turn1 = pipe.generate(seqs[0][:8], prompt_cache=cache, max_tokens=12)
    held = next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))
    second = seqs[0][: held + 6]  # the trained text goes on: what turn 1 wrote, and more
    assert second[: 8 + len(turn1.tokens)] == seqs[0][:8] + turn1.tokens
    turn2 = pipe.generate(second, prompt_cache=cache, max_tokens=20)
    assert turn2.tokens == plain.generate(second, max_tokens=20).tokens
    assert turn2.stats.cached_tokens == held
    st = turn2.stats.per_drafter["qwen_mtp"]
    assert st["head_context_from"] == held and st["hidden_gaps"] == 0
    assert turn2.stats.drafted > 0 and turn2.stats.accepted > 0


def test_greedy_identity_on_text_the_head_never_saw(trained):
    model, _, _ = trained("qwen3_5")
    prompt = [5, 9, 2, 33, 17, 40, 1, 8]
    check_greedy_identity(model, MTP, prompt, max_tokens_list=(3, 24), require_drafts=False)


def test_seeded_identity_with_greedy_drafts(trained):
    model, _, seqs = trained("qwen3_5")
    pol = MTP.with_options("qwen_mtp", sampled_drafts="greedy")
    totals = check_sampled_identity(model, pol, seqs[3][:8], max_tokens=24, temperature=0.7)
    assert totals["accepted"] > 0


def test_the_heads_cache_equals_a_head_fed_only_the_accepted_text(trained, monkeypatch):
    model, _, seqs = trained("qwen3_5")
    sessions = []
    real = QwenMTPDrafter.session

    def recording(self, ctx):
        s = real(self, ctx)
        sessions.append(s)
        return s

    monkeypatch.setattr(QwenMTPDrafter, "session", recording)
    pipe = specdec.assemble(model, policy=MTP)
    history = []
    checked = []

    def check(result, caches):
        s = sessions[-1]
        off = s.fed
        assert s.cache[0].offset == off  # no guessed (recursive) entry is left
        text = history[0] + list(s.tokens[len(history[0]) :])
        h = target_hidden(model, text)
        fresh = s.module.make_cache()
        toks = mx.array(text[1 : off + 1])
        s.module(s.embed(toks)[None], h[None, :off], fresh)
        for mine, ref in zip(s.cache, fresh):
            np.testing.assert_allclose(
                np.array(mine.keys[..., :off, :]), np.array(ref.keys[..., :off, :]), atol=2e-4
            )
            np.testing.assert_allclose(
                np.array(mine.values[..., :off, :]), np.array(ref.values[..., :off, :]), atol=2e-4
            )
        checked.append((len(result.block), result.n_accepted))

    prompt = seqs[4][:8]
    history.append(list(prompt))
    out = pipe.generate(prompt, max_tokens=30, on_round=check)
    assert out.stats.accepted > 0 and len(checked) == out.stats.target_forwards
    assert any(0 < a < k for k, a in checked) and any(a < k for k, a in checked)  # both


def test_sampled_distribution_is_the_targets(trained):
    model, _, seqs = trained("qwen3_5")
    p = check_sampled_distribution(model, MTP, seqs[1][:8], max_tokens=2, n_samples=800)
    assert p > 1e-3


def test_composition_copies_on_a_match_and_uses_the_head_otherwise(trained):
    model, _, seqs = trained("qwen3_5")
    prompt = list(copy_prompt("qwen3_5"))  # ngram_copy gets drafts accepted on it
    assert seqs[-1][: len(prompt)] == prompt
    # ngram_copy sized by its ladder, as NGRAM (see gdn_support): no timing in the test
    pol = specdec.load_policy("copy-mtp").with_options("ngram_copy", sizing="ladder")
    check_greedy_identity(model, pol, prompt, max_tokens_list=(4, 30))
    out = specdec.assemble(model, policy=pol).generate(prompt, max_tokens=30)
    per = out.stats.per_drafter
    assert per["ngram_copy"]["rounds"] > 0 and per["ngram_copy"]["accepted"] > 0
    assert per["qwen_mtp"]["rounds"] > 0 and per["qwen_mtp"]["accepted"] > 0  # where no match
    # The head's cache keeps up through the rounds ngram_copy drafted: no gaps.
    assert per["qwen_mtp"]["hidden_gaps"] == 0


@pytest.mark.parametrize("kind", ["quant", "pruned"])
def test_the_head_drafts_through_the_coarse_head_exactly(trained, kind):
    """specdec-plugin-coarse-head (this plugin's test extra) as the head option."""
    model, _, seqs = trained("qwen3_5")
    pol = MTP.with_options("qwen_mtp", head="coarse_head").with_options(
        "coarse_head", kind=kind, candidates=8, keep=16, group_size=32
    )
    totals = check_greedy_identity(model, pol, seqs[0][:8], max_tokens_list=(1, 9, 30))
    assert totals["accepted"] > 0
    out = specdec.assemble(model, policy=pol).generate(seqs[0][:8], max_tokens=30)
    st = out.stats.draft_heads["coarse_head"]
    assert st["chosen"] == kind and st["calls"] > 0
    assert out.stats.per_drafter["qwen_mtp"]["position_acceptance"][0] > 0.5
    check_sampled_distribution(model, pol, seqs[1][:8], max_tokens=2, n_samples=800)


def test_depth_adapts_and_stays_exact(trained):
    model, _, seqs = trained("qwen3_5")
    pol = MTP.with_options("qwen_mtp", depth=1, max_depth=3, window=4)
    out = specdec.assemble(model, policy=pol).generate(seqs[0][:8], max_tokens=48)
    assert out.tokens == seqs[0][8:56]
    st = out.stats.per_drafter["qwen_mtp"]
    assert st["depth_grew"] >= 1  # position 1 is right on the trained text: it grows
    fixed = MTP.with_options("qwen_mtp", depth=2, adaptive=False)
    out = specdec.assemble(model, policy=fixed).generate(seqs[0][:8], max_tokens=48)
    assert out.tokens == seqs[0][8:56]
    assert out.stats.per_drafter["qwen_mtp"]["depth"] == 2
    assert set(out.stats.block_sizes) <= {0, 1, 2}


# -- the MTP forward against an independent numpy implementation ----------------------


def _np_rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _np_rope(x, dims, base):
    # NeoX layout (mlx traditional=False): rotate halves of the first ``dims`` features.
    L = x.shape[-2]
    half = dims // 2
    inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / dims)
    ang = np.arange(L)[:, None] * inv[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _np_silu(x):
    return x / (1.0 + np.exp(-x))


def _np_mlp(p, pre, x):
    g, u = x @ p[f"{pre}.gate_proj.weight"].T, x @ p[f"{pre}.up_proj.weight"].T
    return (_np_silu(g) * u) @ p[f"{pre}.down_proj.weight"].T


def _np_mtp(p, args, emb, hid):
    """Qwen MTP forward written from the published description, numpy float64."""
    eps = args.rms_norm_eps
    nH, nKV, D = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    x = (
        np.concatenate(
            [
                _np_rms(emb, p["pre_fc_norm_embedding.weight"], eps),
                _np_rms(hid, p["pre_fc_norm_hidden.weight"], eps),
            ],
            axis=-1,
        )
        @ p["fc.weight"].T
    )
    L = x.shape[0]
    a = "layers.0.self_attn"
    r = _np_rms(x, p["layers.0.input_layernorm.weight"], eps)
    qg = (r @ p[f"{a}.q_proj.weight"].T).reshape(L, nH, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(L, nH * D)
    k = (r @ p[f"{a}.k_proj.weight"].T).reshape(L, nKV, D)
    v = (r @ p[f"{a}.v_proj.weight"].T).reshape(L, nKV, D)
    q = _np_rms(q, p[f"{a}.q_norm.weight"], eps).transpose(1, 0, 2)
    k = _np_rms(k, p[f"{a}.k_norm.weight"], eps).transpose(1, 0, 2)
    v = v.transpose(1, 0, 2)
    dims = int(D * args.partial_rotary_factor)
    q, k = _np_rope(q, dims, args.rope_theta), _np_rope(k, dims, args.rope_theta)
    rep = nH // nKV
    k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
    s = q @ k.transpose(0, 2, 1) * D**-0.5
    s = s + np.triu(np.full((L, L), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    att = (s / s.sum(-1, keepdims=True)) @ v  # [nH, L, D]
    att = att.transpose(1, 0, 2).reshape(L, nH * D)
    x = x + (att / (1.0 + np.exp(-gate))) @ p[f"{a}.o_proj.weight"].T
    r = _np_rms(x, p["layers.0.post_attention_layernorm.weight"], eps)
    m = "layers.0.mlp"
    if f"{m}.gate.weight" in p:  # MoE: softmax router, top-k, renormalised, shared expert
        logits = r @ p[f"{m}.gate.weight"].T
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w = w / w.sum(-1, keepdims=True)
        y = np.zeros_like(r)
        for i in range(L):
            top = np.argsort(-w[i])[: args.num_experts_per_tok]
            sc = w[i, top] / w[i, top].sum() if args.norm_topk_prob else w[i, top]
            for e, c in zip(top, sc):
                g = r[i] @ p[f"{m}.switch_mlp.gate_proj.weight"][e].T
                u = r[i] @ p[f"{m}.switch_mlp.up_proj.weight"][e].T
                y[i] += c * ((_np_silu(g) * u) @ p[f"{m}.switch_mlp.down_proj.weight"][e].T)
        sh = _np_mlp(p, f"{m}.shared_expert", r)
        y = y + sh / (1.0 + np.exp(-(r @ p[f"{m}.shared_expert_gate.weight"].T)))
    else:
        y = _np_mlp(p, m, r)
    x = x + y
    return _np_rms(x, p["norm.weight"], eps)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_mtp_forward_matches_an_independent_numpy_reference(arch):
    model = tiny(arch)
    mx.random.seed(7)
    head = QwenMTP(model, 1)
    # Non-trivial norms (fresh ones are all ones).
    params = dict(tree_flatten(head.parameters()))
    for k, v in params.items():
        if k.endswith("norm.weight") or "norm_" in k:
            params[k] = mx.random.uniform(0.5, 1.5, v.shape)
    head.load_weights(list(params.items()))
    args = getattr(model, "language_model", model).args
    L, H = 7, args.hidden_size
    emb = mx.random.normal((L, H))
    hid = mx.random.normal((L, H))
    got = head(emb[None], hid[None], [None])[0]
    p = {k: np.array(v, dtype=np.float64) for k, v in params.items()}
    want = _np_mtp(p, args, np.array(emb, dtype=np.float64), np.array(hid, dtype=np.float64))
    assert (arch == "qwen3_next") == ("layers.0.mlp.gate.weight" in p)  # MoE vs dense
    np.testing.assert_allclose(np.array(got), want, atol=2e-4, rtol=2e-4)
    # With a cache, token by token, the same rows (the positions come from the offset).
    cache = head.make_cache()
    rows = [head(emb[None, i : i + 1], hid[None, i : i + 1], cache)[0, 0] for i in range(L)]
    np.testing.assert_allclose(np.array(mx.stack(rows)), want, atol=2e-4, rtol=2e-4)


# -- rows of a batch --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_batch_rows_draft_together_and_equal_each_prompt_alone(trained, arch, monkeypatch):
    """Rows with different prompt lengths, two at a time (the others join as rows
    finish): each row equals its prompt decoded alone, the head drafts and is accepted,
    and its recursion steps are head calls for every row at once."""
    from specdec_qwen_mtp_gdn.mtp_drafter import QwenMTPBatch

    model, _, seqs = trained(arch)
    made = []
    real = QwenMTPDrafter.batch

    def recording(self, ctx):
        b = real(self, ctx)
        made.append(b)
        return b

    monkeypatch.setattr(QwenMTPDrafter, "batch", recording)
    prompts = [seqs[0][:8], seqs[1][:5], seqs[2][:11], seqs[3][:7]]
    out = check_batch_identity(model, MTP, prompts, max_tokens=[24, 12, 30, 20], max_rows=2)
    assert out["accepted"] > 0 and out["max_batch_rows"] == 2
    assert made and isinstance(made[0], QwenMTPBatch)
    assert made[0].joint_rounds > 0  # two rows' drafts from the same head calls
    rows = specdec.assemble(model, policy=MTP).generate_batch(prompts, max_tokens=24)
    for r in rows:
        st = r.stats.per_drafter["qwen_mtp"]
        assert st["mtp_rounds"] > 0 and st["hidden_gaps"] == 0 and st["batched"]
    assert sum(r.stats.per_drafter["qwen_mtp"]["mtp_accepted"] for r in rows) > 0


def test_batch_rows_mixed_with_copy_drafts(trained):
    model, _, seqs = trained("qwen3_5")
    prompt = list(copy_prompt("qwen3_5"))
    pol = specdec.load_policy("copy-mtp").with_options("ngram_copy", sizing="ladder")
    out = check_batch_identity(model, pol, [prompt, seqs[1][:6], seqs[4][:9]], max_tokens=30)
    assert out["accepted"] > 0
    rows = specdec.assemble(model, policy=pol).generate_batch([prompt, seqs[1][:6]], max_tokens=30)
    assert all(r.stats.per_drafter["qwen_mtp"]["hidden_gaps"] == 0 for r in rows)


def test_sampled_batch_rows_equal_the_same_policy_alone(trained):
    model, _, seqs = trained("qwen3_5")
    prompts = [seqs[1][:8], seqs[3][:6], seqs[4][:10]]
    kw = dict(max_tokens=20, temperature=0.7, seed=3, against="policy")
    assert check_batch_identity(model, MTP, prompts, max_rows=2, **kw)["accepted"] > 0


def test_a_failing_draft_step_leaves_the_other_rows_head_caches_as_they_were(trained):
    """The head raising in a recursion step while only one row drafts: that row fails,
    the other keeps a head cache that holds exactly what it was fed (no guessed entry),
    round after round."""
    model, _, seqs = trained("qwen3_5")
    armed = {"row": None}

    class Gov(specdec.BaseGovernor):
        name = "quiet"
        supports_batch = True

        def session(self, ctx):
            class S(specdec.BaseGovernorSession):
                n = 0

                def budget(self, drafter, max_len):
                    self.n += 1
                    if ctx.row == 1 and self.n == 3:  # row 1 does not draft this round
                        armed["row"] = 0
                        return 0
                    return max_len

            return S()

    class Plugin:
        @specdec.hookimpl
        def specdec_register_governors(self, register):
            register("quiet", Gov)

    with plugin_host(Plugin()) as host:
        pol = specdec.Policy(
            name="mtp-quiet", drafters=("qwen_mtp",), verifier="hidden", governor="quiet"
        )
        pipe = specdec.assemble(model, policy=pol, host=host)
        head = pipe.heads["qwen_mtp"]
        real = head.logits
        calls = {"n": 0}

        def flaky(h, context=None):
            if armed["row"] is not None:
                calls["n"] += 1
                if calls["n"] == 2:  # the second draft step of the armed round
                    armed["row"] = None
                    raise RuntimeError("head failed")
            return real(h, context=context)

        head.logits = flaky
        batch = pipe.batch(2)
        a = batch.add(seqs[0][:8], max_tokens=24)
        b = batch.add(seqs[2][:8], max_tokens=24)
        state = batch._drafting["qwen_mtp"]
        errors, stats = {}, {}
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    errors[ev.row] = ev.error
                elif ev.response.stats is not None:
                    stats[ev.row] = ev.response.stats
            if b in state.sessions:
                s, i = state.sessions[b], state.rows.index(b)
                assert int(state.caches[0].offset[i].item()) == s.fed - s.cached
    assert list(errors) == [a] and "head failed" in str(errors[a].__cause__)
    assert stats[b].accepted > 0
