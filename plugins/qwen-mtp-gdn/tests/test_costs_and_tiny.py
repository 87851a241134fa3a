"""The commit-cost measurement and the tiny-model helpers a benchmark uses."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model
from specdec_qwen_mtp_gdn import STRATEGIES, CommitCost, make_tiny_hybrid, measure_commit_cost
from specdec_qwen_mtp_gdn.costs import main
from specdec_qwen_mtp_gdn.tiny import HYBRID_ARCHITECTURES, save_tiny_hybrid, tiny_hybrid_config


def test_measure_commit_cost_reports_every_strategy():
    costs = measure_commit_cost(make_tiny_hybrid("qwen3_5"), block=3, rounds=2, warmup=1)
    assert [c.strategy for c in costs] == list(STRATEGIES)
    for c in costs:
        assert isinstance(c, CommitCost) and c.n_fed == 4 and c.rounds == 2
        assert c.verify_ms > 0 and c.plain_verify_ms > 0 and c.commit_ms > 0
        assert 0 < c.fraction < 10
        assert json.loads(json.dumps(c.to_dict()))["strategy"] == c.strategy


def test_cost_cli_prints_json_lines(capsys):
    main(["--block", "2", "--rounds", "1", "--strategy", "capture"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["arch"], r["strategy"], r["n_fed"]) for r in rows] == [("qwen3_next", "capture", 3)]


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_tiny_hybrids_mix_gdn_and_attention_layers(arch):
    model = make_tiny_hybrid(arch)
    kinds = [type(c).__name__ for c in model.make_cache()]
    assert kinds == ["ArraysCache", "ArraysCache", "ArraysCache", "KVCache"]
    assert tiny_hybrid_config(arch)["model_type"] == arch
    with pytest.raises(ValueError, match="expected one of"):
        make_tiny_hybrid("mamba")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_saved_tiny_hybrid_loads_back_identically(tmp_path: Path, arch):
    folder = save_tiny_hybrid(tmp_path / arch, arch, mixing=0.2)
    loaded, _ = load_model(folder)
    ref = make_tiny_hybrid(arch, mixing=0.2)
    a, b = dict(tree_flatten(loaded.parameters())), dict(tree_flatten(ref.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    x = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(loaded(x), ref(x))
