"""The kit's tiny Gemma 4 text model: softcapped logits, KV-shared layers, a wrapping window."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import SEED_PROMPT, oracle_policy
from mlx_lm.models import cache as C
from specdec.rollback import KVTrimRollback, RollbackPlan, RotatingWindowRollback
from specdec.testing import (
    cache_view,
    check_caches_match_plain,
    check_greedy_identity,
    copy_heavy_prompt,
    make_tiny_model,
)
from specdec.testing.checks import _compare_views


@pytest.fixture(scope="module")
def gemma4():
    return make_tiny_model("gemma4")


@pytest.fixture(scope="module")
def prompt(gemma4):
    return copy_heavy_prompt(gemma4, SEED_PROMPT, 24)  # 40 tokens: the window of 8 wraps


def test_tiny_gemma4_has_kv_shared_layers_and_a_sliding_window(gemma4):
    args = gemma4.args
    assert args.model_type == "gemma4_text" and args.hidden_size == 64
    assert args.num_kv_shared_layers >= 1 and args.hidden_size_per_layer_input > 0
    layers = gemma4.layers
    caches = C.make_prompt_cache(gemma4)
    # KV-shared layers have no cache of their own: fewer caches than layers
    assert len(caches) == len(layers) - args.num_kv_shared_layers
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache", "KVCache"]
    assert caches[0].max_size == args.sliding_window == 8
    shared = [i for i, layer in enumerate(layers) if not layer.self_attn.has_kv]
    assert shared == [2, 3]
    # each shared layer reads the K/V of the last earlier layer of its type
    assert [gemma4.model.previous_kvs[i] for i in shared] == [0, 1]


def test_logits_are_softcapped(gemma4, prompt):
    cap = gemma4.args.final_logit_softcapping
    assert cap == 10.0
    x = mx.array(prompt)[None]
    logits = gemma4(x, cache=C.make_prompt_cache(gemma4))
    assert float(mx.abs(logits).max()) < cap
    # the cap does something: the head's raw logits go past it
    raw = gemma4.lm_head(gemma4.model(x, cache=C.make_prompt_cache(gemma4)))
    assert float(mx.abs(raw).max()) > cap
    assert np.allclose(np.array(logits), np.array(cap * mx.tanh(raw / cap)), atol=1e-5)


def test_generates_greedily_through_the_plain_pipeline(gemma4, prompt):
    out = specdec.assemble(gemma4, policy="none").generate(prompt, max_tokens=24)
    assert len(out.tokens) == 24 and out.finish_reason == "length"
    assert len(set(out.tokens)) > 4, f"degenerate output: {out.tokens}"
    # every token is the argmax of the model's logits over what precedes it (one
    # uncached forward over prompt + output: the window applies through the mask)
    full = prompt + out.tokens
    logits = gemma4(mx.array(full[:-1])[None])[0, len(prompt) - 1 :]
    assert mx.argmax(logits, axis=-1).tolist() == out.tokens
    assert out.stats.target_forwards == 24 and out.stats.drafted == 0


def test_rollback_plan_covers_the_caches_it_has(gemma4, prompt):
    out = specdec.assemble(gemma4, policy=oracle_policy(gemma4)).generate(prompt, max_tokens=8)
    assert out.stats.rollbacks == ["rotating_window", "kv_trim"]
    assert out.stats.speculation_off_reason is None
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_greedy_identity_with_the_oracle(gemma4, prompt):
    pol = specdec.Policy(drafters=("oracle",), options={"oracle": {"model": gemma4}})
    r = check_greedy_identity(gemma4, pol, prompt)
    assert r["accepted"] == r["drafted"] > 0  # the uncorrupted oracle is always right
    assert r["target_forwards"] < r["plain_forwards"]


@pytest.mark.parametrize("corruption", ["partial", 0.3])
def test_greedy_identity_with_rejections(gemma4, prompt, corruption):
    r = check_greedy_identity(gemma4, oracle_policy(gemma4, corruption, block=5), prompt)
    assert 0 < r["accepted"] < r["drafted"]


@pytest.mark.parametrize("corruption", ["none", "partial"])
def test_caches_match_plain_after_every_round(gemma4, prompt, corruption):
    worst = check_caches_match_plain(
        gemma4, oracle_policy(gemma4, corruption, block=5), prompt, max_tokens=30
    )
    assert worst <= 1e-4


def test_abort_restores_the_caches(gemma4):
    cache = C.make_prompt_cache(gemma4)
    gemma4(mx.array(list(range(1, 15)))[None], cache=cache)  # 14 tokens: the window wrapped
    before = [cache_view(c) for c in cache]
    txn = RollbackPlan(cache, [KVTrimRollback(), RotatingWindowRollback()]).begin()
    gemma4(mx.array([5, 6, 7])[None], cache=cache)
    txn.abort()
    for i, (b, a) in enumerate(zip(before, [cache_view(c) for c in cache])):
        _compare_views(b, a, 0.0, f"cache {i} after abort")
