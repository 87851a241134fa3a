"""``specdec bench --model <config-only hybrid> --random-weights`` with a strategy sweep.

The configs in ``tests/data`` have no weights: the bench builds them with random
weights and a byte tokenizer. A random model does not copy text, so copy drafts
are proposed and rejected: every drafted round rolls the GDN state back, and the
bench reports what that commit cost, per strategy, next to the identity check.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from specdec.cli import main
from specdec.testing import tiny_model_args

DATA = Path(__file__).parent / "data"
STRATEGIES = ("capture", "tape", "rerun")


@pytest.mark.parametrize("config", ["tiny-qwen3-next", "tiny-qwen3-5"])
def test_bench_reports_commit_cost_per_strategy(capsys, tmp_path, config):
    details = tmp_path / "bench.json"
    # The ladder sizing drafts on every match: the cost sizing may find that no block
    # pays on a random model whose drafts are all rejected (it depends on the timings).
    policy = tmp_path / "ngram-ladder.toml"
    policy.write_text(
        'name = "ngram"\ndrafters = ["ngram_copy"]\n\n[options.ngram_copy]\nsizing = "ladder"\n'
    )
    rc = main(
        [
            "bench",
            "--model",
            str(DATA / config),
            "--random-weights",
            "--policy",
            str(policy),
            "--sweep",
            f"gdn_transaction.strategy={','.join(STRATEGIES)}",
            "-w",
            "code-edit",
            "--runs",
            "1",
            "--max-tokens",
            "48",
            "--no-progress",
            "--details",
            str(details),
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "(random weights, seed 0)" in err
    results = json.loads(details.read_text())["results"]
    assert [r["policy"] for r in results] == [
        f"ngram[gdn_transaction.strategy={s}]" for s in STRATEGIES
    ]
    for strategy, r in zip(STRATEGIES, results):
        assert r["identical"] is True  # every run token-identical to plain decoding
        assert f"gdn_transaction:{strategy}" in r["rollbacks"] and "kv_trim" in r["rollbacks"]
        (run,) = r["runs"]["on"]
        assert run["drafted"] > 0  # drafts were proposed, verified and rolled back
        assert run["commit_time_s"] > 0 and run["verify_time_s"] > 0
        assert r["commit_fraction"] > 0
        assert f"| code-edit | 0 | ngram[gdn_transaction.strategy={strategy}] |" in out
    assert r["faithfulness"] is None  # random weights: the output is not scored


def test_sweeping_a_rollback_the_model_does_not_use_is_flagged(capsys, tmp_path):
    """An attention-only model has no GDN cache: the swept strategies change nothing."""
    config = dataclasses.asdict(tiny_model_args("llama", vocab_size=256))
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc = main(
        [
            "bench",
            "--model",
            str(tmp_path),
            "--random-weights",
            "--sweep",
            "gdn_transaction.strategy=capture,tape",
            "-w",
            "prose",
            "--runs",
            "1",
            "--max-tokens",
            "4",
            "--no-progress",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "warning: cache rollback 'gdn_transaction' served no cache of this model" in err
    assert "kv_trim" in err
