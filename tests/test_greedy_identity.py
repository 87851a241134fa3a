"""Greedy output under speculation is token-identical to plain decoding, on every architecture."""

from __future__ import annotations

import pytest
from core_support import SEED_PROMPT, oracle_policy
from specdec.testing import ARCHITECTURES, check_fewer_forwards, check_greedy_identity, plain_greedy


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("corruption", ["none", "partial", "full"])
def test_greedy_identical_for_max_tokens_1_to_16_and_stop(models, copy_prompts, arch, corruption):
    m = models[arch]
    report = check_greedy_identity(
        m, oracle_policy(m, corruption), copy_prompts[arch], require_drafts=corruption != "full"
    )
    assert report["runs"] == 17  # 16 max_tokens values + the stop-token run
    assert report["drafted"] > 0
    if corruption == "none":
        assert report["accepted"] == report["drafted"]
    elif corruption == "full":
        assert report["accepted"] == 0
    else:
        assert 0 < report["accepted"] < report["drafted"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fewer_target_forwards_with_good_drafts(models, copy_prompts, arch):
    m = models[arch]
    plain, spec = check_fewer_forwards(
        m, oracle_policy(m, "none", block=8), copy_prompts[arch], max_tokens=32
    )
    assert plain == 32
    assert spec <= 32 // 4


def test_gemma3_window_wraps_during_the_test(models, copy_prompts):
    # the sliding window is 8: the prompt alone is longer, so every round rolls back a wrapped window
    assert len(copy_prompts["gemma3"]) > 8 * 3
    assert models["gemma3"].args.sliding_window == 8


def test_plain_greedy_is_deterministic(models):
    a = plain_greedy(models["llama"], SEED_PROMPT, 12)
    b = plain_greedy(models["llama"], SEED_PROMPT, 12)
    assert a == b and len(a) == 12
