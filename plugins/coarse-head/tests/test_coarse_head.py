"""coarse_head: exact rescoring, what auto chooses, options, and exact output through it."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import specdec
from specdec.testing import (
    FAULTS,
    check_drafter_faults,
    check_greedy_identity,
    check_sampled_distribution,
    copy_heavy_prompt,
    make_tiny_model,
    require_installed,
)
from specdec_coarse_head import CoarseHead, create_coarse_head

SEED = [5, 9, 2, 33, 17, 40, 8, 21]


def _head(model, tokenizer=None, **options):
    h = create_coarse_head(**options)
    h.bind(model, tokenizer=tokenizer)
    return h


def _states(n=6, hidden=64, seed=0):
    return mx.random.normal((n, hidden), key=mx.random.key(seed)) * 2.0


def _full(model, h):
    return specdec.capture.model_taps(model).head(h[None])[0].astype(mx.float32)


def test_entry_point():
    require_installed("specdec-plugin-coarse-head")
    info = specdec.get_plugin_host().components["draft_head"]["coarse_head"]
    assert info.distribution == "specdec-plugin-coarse-head"


@pytest.mark.parametrize("kind", ["quant", "pruned"])
@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_candidates_carry_the_full_heads_logits(kind, arch):
    model = make_tiny_model(arch)
    head = _head(model, kind=kind, candidates=8, keep=24, group_size=32)
    assert head.chosen == kind
    h = _states()
    got = head.logits(h, context=[60, 61, 62])
    full = _full(model, h)
    finite = np.isfinite(np.array(got))
    assert (finite.sum(axis=-1) == 8).all()  # exactly `candidates` tokens scored
    np.testing.assert_allclose(np.array(got)[finite], np.array(full)[finite], rtol=1e-6, atol=1e-5)
    if kind == "pruned":  # the context's rows are candidates too
        ids = np.array(head._pruned_ids).tolist()
        assert all(t not in ids for t in (60, 61, 62))
        assert head.logits(h, context=[61]).shape == (6, 64)


@pytest.mark.parametrize("kind", ["quant", "pruned", "full"])
def test_all_candidates_reproduce_the_full_heads_argmax(kind):
    model = make_tiny_model("qwen3")
    head = _head(model, kind=kind, candidates=64, keep=64, group_size=32)
    h = _states(16, seed=1)
    assert mx.array_equal(mx.argmax(head.logits(h), -1), mx.argmax(_full(model, h), -1))
    assert head.logits(h[None]).shape == (1, 16, 64)


def test_quantized_target_head():
    model = make_tiny_model("llama", seed=21)
    nn.quantize(model, group_size=32, bits=4)
    for kind in ("quant", "pruned"):
        head = _head(model, kind=kind, candidates=64, keep=64, group_size=32)
        h = _states(4, seed=2)
        got = np.array(head.logits(h))
        np.testing.assert_allclose(got, np.array(_full(model, h)), rtol=1e-5, atol=1e-4)


def test_auto_keeps_the_full_head_when_nothing_is_faster(monkeypatch):
    model = make_tiny_model("llama")
    monkeypatch.setattr(
        CoarseHead,
        "_timings",
        lambda self, kinds: {k: (1.0 if k == "full" else 2.0) for k in kinds},
    )
    head = _head(model, group_size=32)
    st = head.stats()
    assert head.chosen == "full" and st["chosen"] == "full"
    assert st["timings_ms"] == {"full": 1000.0, "quant": 2000.0, "pruned": 2000.0}
    assert "no coarse layer is faster" in st["why"]
    assert st["extra_bytes"] == 0 and head._quant is None and head._pruned is None
    h = _states(3)
    assert mx.array_equal(head.logits(h), _full(model, h))


def test_auto_picks_the_fastest_coarse_layer(monkeypatch):
    model = make_tiny_model("llama")
    fake = {"full": 1.0, "quant": 0.5, "pruned": 0.7}
    monkeypatch.setattr(CoarseHead, "_timings", lambda self, kinds: {k: fake[k] for k in kinds})
    head = _head(model, group_size=32)
    assert head.chosen == "quant" and head._pruned is None and head.extra_bytes > 0
    assert head.stats()["why"].startswith("quant takes 0.50")


def test_auto_times_on_this_device():
    head = _head(make_tiny_model("llama"), group_size=32, timing_reps=2)
    st = head.stats()
    assert set(st["timings_ms"]) == {"full", "quant", "pruned"}
    assert all(v > 0 for v in st["timings_ms"].values())
    assert st["chosen"] in ("full", "quant", "pruned") and st["bind_s"] > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"kind": "tiny"}, "kind must be one of auto, quant, pruned, full"),
        ({"bits": 7}, "bits must be one of 2, 3, 4, 5, 6, 8"),
        ({"group_size": 48}, "group_size must be one of 32, 64, 128"),
        ({"candidates": 0}, "candidates must be an integer >= 1"),
        ({"corpus": "/no/such/corpus"}, "no such file or folder"),
        ({"corpus": "EMPTY"}, "has no .txt, .md or .py file"),
        ({"bits": 3.0}, "bits must be one of"),
        ({"context_tokens": "yes"}, "context_tokens must be true or false"),
        ({"nope": 1}, "nope"),
    ],
)
def test_bad_options_are_named(options, match, tmp_path):
    if options.get("corpus") == "EMPTY":  # a folder without text files
        (tmp_path / "notes.bin").write_bytes(b"\0")
        options = {"corpus": str(tmp_path)}
    with pytest.raises(specdec.PolicyError, match=match):
        create_coarse_head(**options)


def test_quant_with_a_hidden_size_the_group_does_not_divide():
    with pytest.raises(specdec.ModelLoadError, match="not a multiple of group_size 128"):
        _head(make_tiny_model("llama"), kind="quant", group_size=128)


def test_unbound_head_says_so():
    with pytest.raises(RuntimeError, match="not bound"):
        CoarseHead().logits(_states(1))


# -- through drafters -----------------------------------------------------------------


def _draft_policy(draft, head_options, n=3):
    return specdec.Policy(
        name="draft-coarse",
        drafters=("draft_model",),
        options={
            "draft_model": {"model": draft, "num_draft_tokens": n, "head": "coarse_head"},
            "coarse_head": {"candidates": 6, "keep": 12, "group_size": 32, **head_options},
        },
    )


def test_a_faulty_draft_model_through_the_coarse_head_is_named():
    # the kit's fault check on the drafter the coarse head serves
    target = make_tiny_model("llama")
    prompt = copy_heavy_prompt(target, SEED, 24)
    outcomes = check_drafter_faults(
        target, _draft_policy(target, {"kind": "quant"}), prompt, max_tokens=16
    )
    assert {o.fault for o in outcomes} == set(FAULTS)


@pytest.mark.parametrize("kind", ["quant", "pruned"])
def test_greedy_identity_with_draft_model_through_the_coarse_head(kind):
    target = make_tiny_model("llama")
    prompt = copy_heavy_prompt(target, SEED, 24)
    res = check_greedy_identity(target, _draft_policy(target, {"kind": kind}), prompt)
    # the target drafting for itself through a coarse head: most drafts still accepted
    assert res["accepted"] > res["drafted"] / 2
    pipe = specdec.assemble(target, policy=_draft_policy(target, {"kind": kind}))
    out = pipe.generate(prompt, max_tokens=12)
    st = out.stats.draft_heads["coarse_head"]
    assert st["chosen"] == kind and st["calls"] > 0


def test_sampled_distribution_through_the_coarse_head():
    target = make_tiny_model("qwen3")
    prompt = copy_heavy_prompt(target, SEED, 16)
    # q over 6 candidates only: rejection sampling must still give the target's law
    check_sampled_distribution(
        target, _draft_policy(target, {"kind": "pruned"}, n=2), prompt, n_samples=1200
    )


def test_coarse_head_is_built_once_per_model_and_options():
    target = make_tiny_model("llama")
    pol = _draft_policy(target, {"kind": "pruned"})
    a = specdec.assemble(target, policy=pol).heads["draft_model"]
    b = specdec.assemble(target, policy=pol).heads["draft_model"]
    assert a is b and isinstance(a, CoarseHead)


# -- frequencies and variants -----------------------------------------------------------


class _WordTokenizer:
    """Words of a fixed list as tokens (a space-marked and a bare form of each)."""

    WORDS = ["the", "cat", "sat", "on", "mat", "Git", "git", "dog"]

    def __init__(self):
        self.names = ["<eos>"] + [w for x in self.WORDS for w in (x, "\u0120" + x)]
        self.ids = {n: i for i, n in enumerate(self.names)}
        self.eos_token_ids = [0]

    def encode(self, text, add_special_tokens=False):
        out = []
        for i, w in enumerate(text.split()):
            name = w if i == 0 else "\u0120" + w
            if name in self.ids:
                out.append(self.ids[name])
        return out

    def get_vocab(self):
        return dict(self.ids)

    def convert_ids_to_tokens(self, ids):
        return [self.names[i] for i in ids]


def test_frequent_tokens_rank_by_count_then_fill_with_low_ids(tmp_path):
    from specdec_coarse_head.corpus import cached_frequent_tokens

    tok = _WordTokenizer()
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat sat on the mat the cat")
    ids, info = cached_frequent_tokens(tok, str(corpus), 17, 6, tmp_path / "cache")
    # " the" x2, " cat" x1, "the" x1, " sat", " on", " mat": the 6 most frequent (ties: lower
    # id), plus <eos>, no low-id fill needed beyond the keep
    assert info["from_corpus"] == 6 and info["eos"] == 1 and info["cached"] is False
    assert tok.ids["\u0120the"] in ids and 0 in ids
    again, info2 = cached_frequent_tokens(tok, str(corpus), 17, 6, tmp_path / "cache")
    assert info2["cached"] and again.tolist() == ids.tolist()
    corpus.write_text("dog dog dog")  # another corpus: ranked again
    _, info3 = cached_frequent_tokens(tok, str(corpus), 17, 6, tmp_path / "cache")
    assert info3["cached"] is False and info3["lowest_ids"] > 0


def test_variants_join_case_and_word_start_forms():
    import numpy as np
    from specdec_coarse_head.corpus import variant_groups, with_variants

    tok = _WordTokenizer()
    groups = variant_groups(tok, len(tok.names))
    got = with_variants(np.array([tok.ids["\u0120git"]]), groups)
    assert sorted(got.tolist()) == sorted(
        tok.ids[n] for n in ("Git", "\u0120Git", "git", "\u0120git")
    )


def test_pruned_head_scores_context_variants():
    model = make_tiny_model("llama")
    tok = _WordTokenizer()
    head = create_coarse_head(kind="pruned", keep=4, candidates=6, corpus="builtin")
    head.bind(model, tokenizer=tok)
    assert head.stats()["pruned"]["context_variants"]
    # the context holds " git": "Git", " Git" and "git" are scored too
    extra_rows, cols = head._context_extra([tok.ids["\u0120git"]])
    assert {tok.ids[n] for n in ("Git", "\u0120Git", "git")} <= set(cols.tolist())
