"""specdec bench-serve: the agent-loop conversation against real server processes."""

from __future__ import annotations

import argparse
import json

from specdec_serve.bench import MLX_LM, NOCACHE, SPECDEC, load_workload, report, run


def test_the_agent_loop_replays_against_both_servers(tmp_path, capsys):
    work = load_workload()
    assert len(work["turns"]) >= 3 and "{source}" in work["first"]
    args = argparse.Namespace(
        model=None, policy="copy", runs=1, max_tokens=12, baseline=True, server_log=None
    )
    summary = report(run(args))
    s = summary["contenders"]
    assert set(s) == {SPECDEC, NOCACHE, MLX_LM}
    # the same text as mlx_lm.server on every turn, with and without the prefix cache
    assert s[SPECDEC]["identical_to_mlx_lm"] is True
    assert s[NOCACHE]["identical_to_mlx_lm"] is True
    prompts = s[SPECDEC]["prompt_tokens"]
    assert prompts == sorted(prompts) and prompts[0] < prompts[-1]  # the conversation grows
    cached = s[SPECDEC]["cached_tokens"]
    assert cached[0] == 0 and all(c > p // 2 for c, p in zip(cached[1:], prompts[1:]))
    assert s[NOCACHE]["cached_tokens"] == [0] * len(prompts)
    assert all(len(x) == 1 for x in s[SPECDEC]["ttft_s"])
    assert summary["speedup_vs_mlx_lm"] > 0 and summary["ttft_cache_gain"] > 0
    out = capsys.readouterr().out
    assert "identical to mlx_lm.server" in out and "ttft_cache_gain" in out
    json.dumps(summary)  # JSON-able as --json writes it
