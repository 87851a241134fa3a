"""Speculation on a model sharded across two ranks (``mx.distributed``, ring backend).

One two-rank job on 127.0.0.1 (the kit's ``run_ranks``: the ranks started as
``mlx.launch --backend ring`` starts them, bounded by a timeout, every process
killed when one fails or time runs out) runs every case of
``distributed_ranks.py`` on both ranks: the default model sharded tensor-parallel by
specdec's uneven head split (9 query / 3 key-value heads on 2 ranks), and a tiny
random qwen3 sharded by mlx-lm's own ``shard``. The tests compare what the ranks
recorded with each other, round by round, and with this process's single-process
runs of the same models, and check that failures end the request on both ranks
with clear errors instead of hanging.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import specdec
from specdec.bench.runner import first_divergence
from specdec.testing import make_tiny_model, run_ranks
from specdec.testing.ranks import _free_ports

HERE = Path(__file__).parent
#: Wall-clock bound of the whole two-rank job.
JOB_TIMEOUT_S = 900
MAX_TOKENS = 24
#: A greedy sharded run may differ from the single-process one only where the plain
#: top-two logits are this close (the ranks' all_sum adds partial sums in another order).
TIE_GAP = 1e-3
TINY = "tiny-qwen3"


def _launcher() -> list[str]:
    exe = shutil.which("mlx.launch") or str(Path(sys.executable).with_name("mlx.launch"))
    if not Path(exe).exists():
        pytest.fail("mlx.launch (installed with mlx) is not on PATH")
    return [exe]


def run_cases(cases: list[dict], tmp: Path, timeout: float = JOB_TIMEOUT_S) -> list[dict]:
    """Run ``cases`` on two ring ranks; return each rank's results (rank order)."""
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"cases": cases}))
    argv = [sys.executable, str(HERE / "distributed_ranks.py"), str(spec), str(tmp)]
    logs = run_ranks(argv, tmp, timeout=timeout)
    out = []
    for r in range(2):
        res = json.loads((tmp / f"rank{r}.json").read_text())
        assert res.get("done"), f"rank {r} did not finish every case; output:\n{logs[r][-4000:]}"
        assert res["ranks"] == 2, "the job did not run as two ranks"
        out.append(res)
    return out


@pytest.fixture(scope="module")
def default_pipe():
    return specdec.assemble(None, policy="none", distributed=False)


@pytest.fixture(scope="module")
def prompt(default_pipe):
    text = "Repeat this list exactly: apples, pears, plums, apples, pears, plums, figs."
    return default_pipe.encode_prompt(text)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_model("qwen3", vocab_size=256)


@pytest.fixture(scope="module")
def tiny_prompt(tiny):
    from specdec.testing import copy_heavy_prompt

    return copy_heavy_prompt(tiny, [5, 17, 99, 3, 42, 7], n=12)


@pytest.fixture(scope="module")
def tiny_q_single(tiny, tiny_prompt, single):
    """The q-drafting case run in this process (the same drafter, seed and model)."""
    from distributed_ranks import RankTestPlugin
    from specdec.testing import plugin_host

    ref = tiny_prompt + single["tiny_greedy"]
    policy = specdec.Policy(name="prob", drafters=("prob",), options={"prob": {"reference": ref}})
    with plugin_host(RankTestPlugin()):
        pipe = specdec.assemble(tiny, policy=policy, distributed=False)
        return pipe.generate(tiny_prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=9).tokens


@pytest.fixture(scope="module")
def qwen2():
    from core_support import make_tiny_qwen2

    return make_tiny_qwen2()


@pytest.fixture(scope="module")
def single(default_pipe, prompt, tiny, tiny_prompt, qwen2):
    """The single-process runs the sharded ones are compared with."""
    tiny_pipe = specdec.assemble(tiny, policy="none", distributed=False)
    qwen2_pipe = specdec.assemble(qwen2, policy="none", distributed=False)
    return {
        "qwen2_greedy": qwen2_pipe.generate(tiny_prompt, max_tokens=MAX_TOKENS).tokens,
        "qwen2_sampled": qwen2_pipe.generate(
            tiny_prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=5
        ).tokens,
        "greedy": default_pipe.generate(prompt, max_tokens=MAX_TOKENS).tokens,
        "sampled": default_pipe.generate(
            prompt, max_tokens=MAX_TOKENS, temperature=0.8, seed=7
        ).tokens,
        "tiny_greedy": tiny_pipe.generate(tiny_prompt, max_tokens=MAX_TOKENS).tokens,
        "tiny_sampled": tiny_pipe.generate(
            tiny_prompt, max_tokens=MAX_TOKENS, temperature=1.0, seed=3
        ).tokens,
    }


def _oracle(reference: list[int], **extra) -> dict:
    return {
        "name": "faulty",
        "drafters": ["faulty"],
        "options": {"faulty": {"reference": reference, "block": 4, **extra}},
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, prompt, tiny_prompt, single):
    ref = prompt + single["greedy"]
    tiny_ref = tiny_prompt + single["tiny_greedy"]
    qwen2_ref = tiny_prompt + single["qwen2_greedy"]
    pipe = {
        "model": "tiny-qwen2",
        "sharding": "pipeline",
        "prompt": tiny_prompt,
        "max_tokens": MAX_TOKENS,
    }
    base = {"model": "default", "prompt": prompt, "max_tokens": MAX_TOKENS}
    acceptor_fails = _oracle(ref)
    acceptor_fails["acceptor"] = "faulty_greedy"
    acceptor_fails["options"]["faulty_greedy"] = {"fail_rank": 1, "fail_at": 3}
    cases = [
        {**base, "name": "none", "policy": "none", "record_rounds": True},
        {**base, "name": "copy", "policy": "copy", "record_rounds": True},
        {**base, "name": "copy-sampled", "policy": "copy", "temperature": 0.8, "seed": 7},
        {**base, "name": "copy-noseed", "policy": "copy", "temperature": 0.8},
        {**base, "name": "skew", "policy": _oracle(ref, skew_rank=1), "record_rounds": True},
        {**base, "name": "drafter-fails", "policy": _oracle(ref, fail_rank=1, fail_at=3)},
        {**base, "name": "acceptor-fails", "policy": acceptor_fails},
        # rank 1 bans the token plain decoding emits 5th, from then on: its output
        # differs from rank 0's
        {
            **base,
            "name": "diverge",
            "policy": "none",
            "ban": [1, single["greedy"][4], len(prompt) + 4],
        },
        {**base, "name": "close", "policy": "copy", "close_on_rank": 1, "close_after": 3},
        # a processor raising on rank 1 after a round's exchange, its forward built
        {**base, "name": "processor-fails-plain", "policy": "none", "raise": [1, len(prompt) + 4]},
        {**base, "name": "processor-fails", "policy": _oracle(ref), "raise": [1, len(prompt) + 6]},
        {**base, "name": "after-failures", "policy": "copy"},
        {
            "model": TINY,
            "name": "tiny-none",
            "prompt": tiny_prompt,
            "max_tokens": MAX_TOKENS,
            "policy": "none",
        },
        {
            "model": TINY,
            "name": "tiny-oracle",
            "prompt": tiny_prompt,
            "max_tokens": MAX_TOKENS,
            "policy": _oracle(tiny_ref),
            "record_rounds": True,
        },
        {
            "model": TINY,
            "name": "tiny-q-sampled",
            "prompt": tiny_prompt,
            "max_tokens": MAX_TOKENS,
            "policy": {
                "name": "prob",
                "drafters": ["prob"],
                "options": {"prob": {"reference": tiny_ref}},
            },
            "temperature": 1.0,
            "seed": 9,
            "record_rounds": True,
        },
        {**pipe, "name": "pipeline-none", "policy": "none", "record_rounds": True},
        {**pipe, "name": "pipeline-oracle", "policy": _oracle(qwen2_ref), "record_rounds": True},
        {
            **pipe,
            "name": "pipeline-oracle-sampled",
            "policy": _oracle(qwen2_ref),
            "temperature": 1.0,
            "seed": 5,
        },
        {**pipe, "name": "pipeline-fails", "policy": _oracle(qwen2_ref, fail_rank=1, fail_at=3)},
        {
            "model": TINY,
            "name": "tiny-oracle-sampled",
            "prompt": tiny_prompt,
            "max_tokens": MAX_TOKENS,
            "policy": _oracle(tiny_ref),
            "temperature": 1.0,
            "seed": 3,
        },
    ]
    return run_cases(cases, tmp_path_factory.mktemp("ranks"))


def _case(ranks, name):
    return [r["cases"][name] for r in ranks]


def _assert_same_as_single(model, prompt, want, got):
    """Sharded greedy output equals the single-process one, or differs first where plain
    decoding was at a near-tie (reported)."""
    if got == want:
        return
    d = first_divergence(model, prompt, want, got)
    gap = d["plain_top2_gap"]
    assert gap is not None and gap < TIE_GAP, (
        f"sharded output differs from the single-process run at {d}: not a near-tie"
    )


def _dist(case):
    return case["stats"]["distributed"]


def test_ranks_agree_every_round(ranks):
    for name in ("none", "copy", "skew", "tiny-oracle"):
        a, b = _case(ranks, name)
        assert a["error"] is None and b["error"] is None, (name, a["error"], b["error"])
        assert a["rounds"], f"{name}: no rounds were recorded"
        assert a["rounds"] == b["rounds"], f"{name}: the ranks' rounds differ"
        assert a["tokens"] == b["tokens"]


def test_greedy_sharded_equals_single_process(ranks, default_pipe, prompt, single):
    for name in ("none", "copy", "skew", "after-failures"):
        a, b = _case(ranks, name)
        assert a["error"] is None, (name, a["error"])
        assert a["tokens"] == b["tokens"]
        _assert_same_as_single(default_pipe.model, prompt, single["greedy"], a["tokens"])
    none, copy = _case(ranks, "none")[0], _case(ranks, "copy")[0]
    assert none["tokens"] == copy["tokens"]
    # the copy policy drafted and the target accepted drafts, on the sharded model
    assert copy["stats"]["drafted"] > 0 and copy["stats"]["accepted"] > 0
    assert copy["stats"]["target_forwards"] < none["stats"]["target_forwards"]


def test_collectives_per_token_fall_with_speculation(ranks):
    none, copy = _case(ranks, "none")[0], _case(ranks, "copy")[0]
    dn, dc = _dist(none), _dist(copy)
    assert dn["ranks"] == 2 and dn["kind"] == "tensor" and dn["method"] == "uneven-heads"
    assert dn["heads"] == [[6, 2], [3, 1]]
    # 30 layers, an all_sum after attention and after the MLP
    assert dn["collectives_per_forward"] == 60
    assert dn["decode_forwards"] == none["stats"]["target_forwards"]
    assert dn["model_collectives"] == 60 * dn["decode_forwards"]
    assert dc["collectives_per_token"] < dn["collectives_per_token"]
    n = none["stats"]["generation_tokens"]
    assert dn["collectives_per_token"] == pytest.approx(dn["collectives"] / n)


def test_seeded_sampling_with_copy_drafts_equals_single_process(ranks, single):
    a, b = _case(ranks, "copy-sampled")
    assert a["error"] is None and a["tokens"] == b["tokens"]
    assert a["tokens"] == single["sampled"]
    # without a seed, every rank samples with rank 0's
    a, b = _case(ranks, "copy-noseed")
    assert a["error"] is None and a["tokens"] == b["tokens"]


def test_rank0_block_is_verified_when_a_rank_proposes_another(ranks):
    a, b = _case(ranks, "skew")
    assert _dist(a)["block_overrides"] == 0
    assert _dist(b)["block_overrides"] > 0
    assert a["stats"]["accepted"] > 0 and a["stats"]["drafted"] == b["stats"]["drafted"]


def test_failure_on_one_rank_ends_the_request_on_both(ranks):
    for name, what in (("drafter-fails", "drafter"), ("acceptor-fails", "acceptor")):
        a, b = _case(ranks, name)
        # the failing rank names the component (a specdec.ComponentError, a RuntimeError)
        assert b["error_type"] == "ComponentError" and f"injected {what} failure" in b["error"]
        assert f"{what} '" in b["error"] and "in round 3" in b["error"], b["error"]
        assert a["error_type"] == "DistributedError", (name, a["error"])
        # both fail in their third call: the third round
        assert "rank 1 failed at round 3:" in a["error"], a["error"]
        assert f"injected {what} failure" in a["error"]


def test_failure_after_the_exchange_with_the_forward_built(ranks):
    """A logits processor raising on rank 1 in round 5 or later (plain) and in a
    speculative round: rank 1 runs the forward it built, then tells rank 0."""
    for name in ("processor-fails-plain", "processor-fails"):
        a, b = _case(ranks, name)
        assert b["error_type"] == "RuntimeError" and "injected processor failure" in b["error"]
        assert a["error_type"] == "DistributedError", (name, a["error"])
        assert "rank 1 failed at round" in a["error"] and "processor failure" in a["error"]
    # and both ranks went on serving: the next cases ran in step
    assert _case(ranks, "after-failures")[0]["tokens"] == _case(ranks, "copy")[0]["tokens"]


def test_draft_probabilities_are_broadcast_from_rank_0(ranks, tiny, tiny_prompt, tiny_q_single):
    """A drafter with q that does not declare itself deterministic: rank 0's q is
    broadcast every drafted round, the ranks agree, and the output is the one
    process's with the same drafter and seed (rejection sampling with q)."""
    a, b = _case(ranks, "tiny-q-sampled")
    assert a["error"] is None and b["error"] is None
    assert a["rounds"] == b["rounds"] and a["tokens"] == b["tokens"] == tiny_q_single
    assert a["stats"]["acceptors"].get("rejection", 0) > 0
    assert _dist(a)["q_broadcasts"] == a["stats"]["rounds_with_draft"] > 0


def test_divergence_fails_loudly_on_both_ranks(ranks):
    a, b = _case(ranks, "diverge")
    for r in (a, b):
        assert r["error_type"] == "DistributedError" and "ranks diverged" in r["error"], r["error"]


def test_a_rank_that_stops_reading_ends_the_request(ranks):
    a, b = _case(ranks, "close")
    assert b["error"] is None and len(b["tokens"]) == 3
    assert a["error_type"] == "DistributedError", a["error"]
    assert "rank 1 stopped reading the stream at round" in a["error"]


def test_tiny_model_of_another_architecture(ranks, tiny, tiny_prompt, single):
    none, oracle = _case(ranks, "tiny-none")[0], _case(ranks, "tiny-oracle")[0]
    assert _dist(none)["method"] == "mlx-lm"
    assert _dist(none)["collectives_per_forward"] == 4  # 2 layers
    _assert_same_as_single(tiny, tiny_prompt, single["tiny_greedy"], none["tokens"])
    assert oracle["tokens"] == none["tokens"]
    assert oracle["stats"]["accepted"] > 0
    a, b = _case(ranks, "tiny-oracle-sampled")
    assert a["error"] is None and a["tokens"] == b["tokens"] == single["tiny_sampled"]


def test_pipeline_parallel(ranks, single):
    """mlx-lm's pipeline(group): each rank runs one of the tiny qwen2's two layers."""
    none = _case(ranks, "pipeline-none")
    for r, case in enumerate(none):
        d = _dist(case)
        assert (d["kind"], d["method"]) == ("pipeline", "mlx-lm")
        assert d["layers"] == ([1, 2] if r == 0 else [0, 1])
        # rank 0: recv + all_gather; rank 1: send + all_gather
        assert d["collectives_per_forward"] == 2
    a, b = _case(ranks, "pipeline-oracle")
    assert a["error"] is None and a["rounds"] and a["rounds"] == b["rounds"]
    assert none[0]["rounds"] == none[1]["rounds"]
    # a pipeline adds no partial sums: exactly the single-process output
    assert none[0]["tokens"] == a["tokens"] == single["qwen2_greedy"]
    assert a["stats"]["accepted"] > 0
    assert _dist(a)["collectives_per_token"] < _dist(none[0])["collectives_per_token"]
    a, b = _case(ranks, "pipeline-oracle-sampled")
    assert a["error"] is None and a["tokens"] == b["tokens"] == single["qwen2_sampled"]
    a, b = _case(ranks, "pipeline-fails")
    assert b["error_type"] == "ComponentError" and a["error_type"] == "DistributedError"
    assert "rank 1 failed at round 3:" in a["error"]


def test_sharding_outside_a_job_is_a_clear_error():
    with pytest.raises(specdec.DistributedError, match="sharding='pipeline'.*mlx.launch"):
        specdec.assemble(make_tiny_model("llama"), policy="none", sharding="pipeline")
    with pytest.raises(specdec.PolicyError, match="sharding must be one of"):
        specdec.assemble(make_tiny_model("llama"), policy="none", sharding="rows")


def test_distributed_true_outside_a_job_is_a_clear_error():
    with pytest.raises(specdec.DistributedError, match="mlx.launch"):
        specdec.assemble(make_tiny_model("llama"), policy="none", distributed=True)


def test_generate_under_mlx_launch(tmp_path, default_pipe):
    """What a user types: mlx.launch runs specdec generate on two ranks; rank 0 prints."""
    text = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."
    cmd = [
        *_launcher(),
        "--backend",
        "ring",
        "-n",
        "2",
        "--hosts",
        "127.0.0.1",
        "--starting-port",
        str(_free_ports(2)),
        "--env",
        "OPENBLAS_NUM_THREADS=1",
        str(Path(sys.executable).with_name("specdec")),
        "generate",
        "--policy",
        "copy",
        "--max-tokens",
        "12",
        "--stats",
        "--json",
        "--prompt",
        text,
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"mlx.launch ran past 300s; stderr:\n{err[-4000:]}")
    assert "Node with rank" not in err, err[-4000:]  # mlx.launch's warning of a failed rank
    lines = [x for x in err.splitlines() if x.startswith("specdec: policy=copy")]
    assert len(lines) == 1, f"expected one stats line (rank 0's):\n{err[-4000:]}"
    assert "2 ranks" in lines[0] and "collectives/token" in lines[0]
    doc = json.loads(out)  # one JSON object: rank 1 printed nothing
    assert doc["stats"]["distributed"]["ranks"] == 2
    want = default_pipe.generate(default_pipe.encode_prompt(text), max_tokens=12).tokens
    _assert_same_as_single(
        default_pipe.model, default_pipe.encode_prompt(text), want, doc["tokens"]
    )


class _FakeGroup:
    """Stands for a group of ``n`` ranks where only the split decisions are checked
    (the errors come before any collective is built)."""

    def __init__(self, n: int, rank: int = 0):
        self.n, self.r = n, rank

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.r


def test_shard_model_refuses_more_ranks_than_key_value_heads():
    from specdec.distributed import shard_model

    model = make_tiny_model("llama", vocab_size=64, seed=11)  # 4 query, 2 key/value heads
    with pytest.raises(specdec.ModelLoadError, match="2 key/value heads.*at most 2 ranks"):
        shard_model(model, _FakeGroup(3))


def test_uneven_split_refuses_quantized_layers():
    import mlx.nn as nn
    from specdec.distributed import shard_model

    model = make_tiny_model(
        "llama",
        vocab_size=64,
        seed=12,
        num_attention_heads=6,
        num_key_value_heads=3,
        hidden_size=96,
    )
    nn.quantize(model, group_size=32, bits=4)
    with pytest.raises(specdec.ModelLoadError, match="QuantizedLinear layers are not supported"):
        shard_model(model, _FakeGroup(2))


def test_bench_distributed_on_two_ranks(tmp_path):
    """specdec bench --distributed --compare-single on a random tiny llama: rank 0 prints
    the records and the tables (collectives per token, both ratios), rank 1 nothing."""
    from core_support import tiny_config

    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(tiny_config()))
    argv = [
        str(Path(sys.executable).with_name("specdec")),
        "bench",
        "--distributed",
        "--compare-single",
        "--model",
        str(folder),
        "--random-weights",
        "-w",
        "prose",
        "--runs",
        "1",
        "--max-tokens",
        "8",
        "--no-progress",
        "--details",
        str(tmp_path / "details.json"),
    ]
    out0, out1 = run_ranks(argv, tmp_path, timeout=300)
    assert "| workload |" not in out1, out1[-2000:]  # rank 1 prints no table
    (res,) = json.loads((tmp_path / "details.json").read_text())["results"]  # rank 0's
    assert res["workload"] == "prose" and res["identical"]
    # plain: 8 forwards of 4 all_sums, 8 round exchanges, 2 at the start, 1 at the end
    assert res["off_collectives_per_token"] == pytest.approx((8 * 4 + 8 + 3) / 8)
    assert 0 < res["on_collectives_per_token"] <= res["off_collectives_per_token"]
    assert "sharded across 2 ranks (tensor, mlx-lm, 4 collectives per forward)" in out0
    assert "| off collectives/token | on collectives/token |" in out0
    assert "| 2 ranks ratio | single off tok/s |" in out0 and "| same tokens as single |" in out0
