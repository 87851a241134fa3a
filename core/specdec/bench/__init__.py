"""``specdec bench``: speculative decoding against plain decoding on shipped workloads.

Library use::

    from mlx_lm import load
    from specdec.bench import get_workloads, run_bench

    model, tokenizer = load("path/to/model")
    results = run_bench(model, tokenizer, get_workloads(["code-edit"]), policy="copy")
    [r.record() for r in results]   # the --json records
"""

from __future__ import annotations

from .progress import Progress
from .runner import (
    BASELINES,
    RECORD_FIELDS,
    SHORT_ANSWER_TOKENS,
    RunSample,
    WorkloadResult,
    grammar_table,
    parse_sweep,
    policy_pairs,
    run_bench,
    spec_baseline_table,
    sweep_policies,
    total_steps,
)
from .workloads import Workload, faithfulness, get_workloads, load_workloads, workload_names

__all__ = [
    "BASELINES",
    "RECORD_FIELDS",
    "SHORT_ANSWER_TOKENS",
    "Progress",
    "RunSample",
    "Workload",
    "WorkloadResult",
    "faithfulness",
    "get_workloads",
    "grammar_table",
    "grammar_table",
    "load_workloads",
    "parse_sweep",
    "policy_pairs",
    "run_bench",
    "spec_baseline_table",
    "sweep_policies",
    "total_steps",
    "workload_names",
]
