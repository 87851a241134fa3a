"""The plugin is installed, listed, and configured through the policy."""

from __future__ import annotations

import mlx.core as mx
import pytest
import specdec
from gdn_support import NGRAM, copy_model, copy_prompt
from specdec.testing import require_installed
from specdec_qwen_mtp_gdn import STRATEGIES, GatedDeltaRollback, default_strategy


def test_entry_point_is_installed():
    # require_installed skips when the tests run from a source tree, and fails under CI
    dist = require_installed("specdec-plugin-qwen-mtp-gdn")
    eps = [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "specdec"]
    assert eps == [("qwen_mtp_gdn", "specdec_qwen_mtp_gdn.plugin")]


def test_rollback_is_registered_by_the_distribution():
    host = specdec.get_plugin_host()
    info = host.get("cache_rollback", "gdn_transaction")
    assert info.distribution == "specdec-plugin-qwen-mtp-gdn"
    listed = host.to_dict(include_builtins=False)
    mine = [p for p in listed["plugins"] if p["distribution"] == "specdec-plugin-qwen-mtp-gdn"]
    assert mine and mine[0]["components"] == {
        "cache_rollback": ["gdn_transaction"],
        "drafter": ["qwen_mtp"],
    }


def platform_default_strategy() -> str:
    """The documented default: ``tape`` where mlx-lm's fused Metal GDN kernel runs (the
    Metal GPU), ``capture`` where its ops recurrence runs (CPU, CUDA)."""
    return "tape" if mx.metal.is_available() and mx.default_device() == mx.gpu else "capture"


def test_default_strategy_is_the_platforms():
    expected = platform_default_strategy()
    assert default_strategy() == expected
    assert GatedDeltaRollback().strategy == expected
    assert GatedDeltaRollback(strategy="auto").name == f"gdn_transaction:{expected}"


def test_default_strategy_follows_the_default_device():
    """With the CPU as default device mlx-lm runs the ops recurrence on every platform: capture."""
    previous = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        assert default_strategy() == "capture"
        assert GatedDeltaRollback().name == "gdn_transaction:capture"
    finally:
        mx.set_default_device(previous)


def test_bad_strategy_is_a_policy_error():
    with pytest.raises(specdec.PolicyError, match="strategy must be one of"):
        GatedDeltaRollback(strategy="snapshot")
    model = copy_model("qwen3_next")
    pol = specdec.Policy(
        drafters=("ngram_copy",), options={"gdn_transaction": {"strategy": "nope"}}
    )
    with pytest.raises(specdec.PolicyError):
        specdec.assemble(model, policy=pol).generate([1, 2, 3], max_tokens=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stats_say_which_strategy_ran(strategy):
    model = copy_model("qwen3_next")
    pol = specdec.Policy(
        drafters=("ngram_copy",),
        rollback="gdn_transaction",
        options={"gdn_transaction": {"strategy": strategy}},
    )
    out = specdec.assemble(model, policy=pol).generate(
        list(copy_prompt("qwen3_next")), max_tokens=8
    )
    assert out.stats.rollbacks == [f"gdn_transaction:{strategy}", "kv_trim"]
    assert out.stats.speculation_off_reason is None
    assert out.stats.drafted > 0


def test_auto_picks_the_plugin_for_gdn_layers_and_kv_trim_for_attention():
    model = copy_model("qwen3_5")
    out = specdec.assemble(model, policy=NGRAM).generate(list(copy_prompt("qwen3_5")), max_tokens=4)
    assert out.stats.rollbacks == [f"gdn_transaction:{platform_default_strategy()}", "kv_trim"]
