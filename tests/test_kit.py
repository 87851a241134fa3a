"""The test kit itself and the built-in verifiers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import (
    ARCHITECTURES,
    OracleDrafter,
    check_greedy_identity,
    copy_heavy_prompt,
    plain_greedy,
)
from specdec.verifiers import HiddenStateVerifier, LogitsVerifier


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hidden_verifier_returns_the_same_logits_plus_hidden_states(models, arch):
    m = models[arch]
    toks = mx.array([3, 4, 5, 6])
    a = LogitsVerifier().verify(m, toks, make_prompt_cache(m))
    b = HiddenStateVerifier().verify(m, toks, make_prompt_cache(m))
    assert np.allclose(np.array(a.logits), np.array(b.logits), atol=1e-5)
    assert b.hidden.shape == (4, m.args.hidden_size)
    assert a.hidden is None


def test_hidden_verifier_pipeline_is_identical(models, copy_prompts):
    m = models["llama"]
    pol = specdec.Policy(drafters=("oracle",), verifier="hidden", options={"oracle": {"model": m}})
    out = specdec.assemble(m, policy=pol).generate(copy_prompts["llama"], max_tokens=12)
    assert out.tokens == plain_greedy(m, copy_prompts["llama"], 12)
    assert out.stats.verifier == "hidden"


def test_tiny_models_are_cached_and_distinct(specdec_tiny_model):
    a = specdec_tiny_model("llama")
    assert a is specdec_tiny_model("llama")
    assert a is not specdec_tiny_model("llama", seed=2)
    for arch in ARCHITECTURES:
        m = specdec_tiny_model(arch)
        out = plain_greedy(m, [3, 17, 42, 9, 28, 5, 61, 11], 16)
        assert len(set(out)) > 2, f"{arch} tiny model output is degenerate: {out}"
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        specdec_tiny_model("mamba")


def test_gemma3_tiny_model_has_wrapping_sliding_window(models):
    caches = make_prompt_cache(models["gemma3"])
    kinds = [type(c).__name__ for c in caches]
    assert "RotatingKVCache" in kinds and "KVCache" in kinds
    assert min(c.max_size for c in caches if type(c).__name__ == "RotatingKVCache") == 8


def test_oracle_corruption_modes(models):
    m = models["llama"]
    h = copy_heavy_prompt(m, [3, 17, 42, 9, 28, 5, 61, 11], 8)
    truth = plain_greedy(m, h, 6)
    assert OracleDrafter(model=m, block=6).propose(h, 6).tokens == tuple(truth)
    full = OracleDrafter(model=m, corruption="full", block=6).propose(h, 6).tokens
    assert all(a != b for a, b in zip(full, truth))
    part = OracleDrafter(model=m, corruption="partial", block=6).propose(h, 6).tokens
    assert sum(a != b for a, b in zip(part, truth)) == 1
    ref = OracleDrafter(reference=h + truth, vocab_size=64)
    assert ref.propose(h, 3).tokens == tuple(truth[:3])
    assert ref.propose([1, 2], 3) is None
    with pytest.raises(ValueError, match="corruption must be one of"):
        OracleDrafter(model=m, corruption="some")


def test_fresh_host_fixture(specdec_fresh_host):
    assert specdec.get_plugin_host() is specdec_fresh_host
    assert "draft_model" in specdec_fresh_host.names("drafter")


def test_greedy_identity_check_with_stop_as_first_token(models, copy_prompts):
    m = models["llama"]
    first = plain_greedy(m, copy_prompts["llama"], 1)[0]
    pol = specdec.Policy(drafters=("oracle",), options={"oracle": {"model": m}})
    r = check_greedy_identity(
        m,
        pol,
        copy_prompts["llama"],
        max_tokens_list=[4],
        stop_tokens=[first],
        require_drafts=False,
    )
    assert r["runs"] == 2


def test_cache_view_compares_arrays_cache_entries():
    """``ArraysCache.state`` is ``(list of arrays, left_padding, lengths)``: every array is compared."""
    from mlx_lm.models.cache import ArraysCache
    from specdec.testing import cache_view
    from specdec.testing.checks import _compare_views

    a, b = ArraysCache(2), ArraysCache(2)
    a[0], a[1] = mx.zeros((1, 3, 4)), mx.ones((1, 2, 2, 2))
    b[0], b[1] = mx.zeros((1, 3, 4)), mx.ones((1, 2, 2, 2))
    assert _compare_views(cache_view(a), cache_view(b), 1e-6, "same") == 0.0
    b[1] = b[1] + 1e-3
    with pytest.raises(AssertionError, match="max abs difference"):
        _compare_views(cache_view(a), cache_view(b), 1e-6, "different")
