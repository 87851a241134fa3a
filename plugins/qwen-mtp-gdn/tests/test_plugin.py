"""The plugin is installed, listed, and configured through the policy."""

from __future__ import annotations

import importlib.metadata

import pytest
import specdec
from gdn_support import NGRAM, copy_model, copy_prompt
from specdec_qwen_mtp_gdn import STRATEGIES, GatedDeltaRollback, default_strategy


def test_entry_point_is_installed():
    eps = importlib.metadata.entry_points(group="specdec")
    ep = next(e for e in eps if e.name == "qwen_mtp_gdn")
    assert ep.value == "specdec_qwen_mtp_gdn.plugin"
    assert ep.dist.name == "specdec-plugin-qwen-mtp-gdn"


def test_rollback_is_registered_by_the_distribution():
    host = specdec.get_plugin_host()
    info = host.get("cache_rollback", "gdn_transaction")
    assert info.distribution == "specdec-plugin-qwen-mtp-gdn"
    listed = host.to_dict(include_builtins=False)
    mine = [p for p in listed["plugins"] if p["distribution"] == "specdec-plugin-qwen-mtp-gdn"]
    assert mine and mine[0]["components"] == {"cache_rollback": ["gdn_transaction"]}


def test_default_strategy_is_capture_where_the_ops_recurrence_runs():
    assert default_strategy() == "capture"  # CPU here; the Metal kernel path picks tape
    assert GatedDeltaRollback().strategy == "capture"
    assert GatedDeltaRollback().name == "gdn_transaction:capture"


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
    assert out.stats.rollbacks == ["gdn_transaction:capture", "kv_trim"]
