"""``specdec bench --batch``: aggregate throughput of B rows decoded together.

For each workload and batch size B, the contenders decode the workload's prompt
as B rows, greedily, interleaved run by run (the order rotates every run):

* ``off``: specdec with the ``none`` policy (plain decoding in a batch);
* ``on``: specdec with the measured policy (each row speculating on its own); with
  several policies, each is a contender, measured against the same ``off`` and
  ``mlx-lm`` runs (one record per policy);
* ``mlx-lm``: mlx-lm's ``batch_generate`` on the same prompts.

The figure is aggregate decode tok/s: the tokens of every row over the decoding
time (prompt processing excluded: for specdec from the first round to the last;
for mlx-lm its own ``generation_tps``). The prompt is prefilled once per workload
and every row of every contender starts from a copy of that cache (specdec's
``Batch.add(prompt_cache=...)``, mlx-lm's ``prompt_caches``), so the runs pay for
decoding only. Each row's output is compared with the prompt decoded alone by
plain decoding.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..assembly import assemble
from ..errors import RequestError
from ..policy import Policy
from ..presets import load_policy
from .workloads import Workload

KINDS = ("off", "on", "mlx-lm")


@attrs.define
class BatchResult:
    """One workload at one batch size."""

    workload: str
    batch: int
    policy: str
    prompt_tokens: int
    tps: dict = attrs.field(factory=dict)  # kind -> [aggregate tok/s per run]
    identical: dict = attrs.field(factory=dict)  # kind -> [rows equal alone, per run]
    tokens_per_forward: list = attrs.field(factory=list)  # on: mean over rows, per run
    acceptance: list = attrs.field(factory=list)
    #: on: ``{width: rounds}`` over every run, rounds with all B rows only (tokens fed
    #: per row: the batch's sizing, :func:`specdec.costs.best_width`)
    widths: dict = attrs.field(factory=dict)
    #: on: drafted tokens the batch's sizing cut, per run (all rows)
    cut: list = attrs.field(factory=list)

    def median(self, kind: str) -> float:
        return float(statistics.median(self.tps[kind])) if self.tps.get(kind) else 0.0

    @property
    def mean_width(self) -> float:
        """Tokens fed per row in the policy's rounds with every row, on average."""
        n = sum(self.widths.values())
        return sum(w * c for w, c in self.widths.items()) / n if n else 0.0

    def record(self) -> dict:
        off, on, mlx = (self.median(k) for k in KINDS)
        return {
            "workload": self.workload,
            "batch": self.batch,
            "policy": self.policy,
            "prompt_tokens": self.prompt_tokens,
            "off_tps": round(off, 2),
            "on_tps": round(on, 2),
            "mlx_lm_tps": round(mlx, 2),
            "on_vs_off": round(on / off, 3) if off else None,
            "on_vs_mlx_lm": round(on / mlx, 3) if mlx else None,
            "tokens_per_forward": round(statistics.median(self.tokens_per_forward), 3)
            if self.tokens_per_forward
            else None,
            "acceptance_rate": round(statistics.median(self.acceptance), 3)
            if self.acceptance
            else None,
            "widths": {w: self.widths[w] for w in sorted(self.widths)},
            "mean_width": round(self.mean_width, 2) if self.widths else None,
            "cut_tokens": round(statistics.median(self.cut), 1) if self.cut else None,
            "rows_identical": {
                k: f"{sum(v)}/{len(v) * self.batch}" for k, v in self.identical.items()
            },
            "runs": {k: [round(x, 2) for x in v] for k, v in self.tps.items()},
        }


def _prefilled(model: Any, ids: list[int], step: int = 512) -> list:
    """The model's caches holding every token of ``ids`` but the last."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for start in range(0, len(ids) - 1, step):
        model(mx.array(ids[start : min(start + step, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def _specdec(
    pipe: Any, ids: list[int], rows: int, cache: list, max_tokens: int
) -> tuple[float, list, list, dict]:
    batch = pipe.batch(rows)
    for _ in range(rows):
        batch.add(ids, prompt_cache=cache, max_tokens=max_tokens)
    out: dict[int, list] = {}
    last: dict[int, Any] = {}
    try:
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    raise ev.error
                if not ev.response.is_stop_token:
                    out.setdefault(ev.row, []).append(ev.response.token)
                last[ev.row] = ev.response
    finally:
        batch.close()
    stats = [last[k].stats for k in sorted(last)]
    tokens = sum(len(v) for v in out.values())
    t = max(s.decode_time_s for s in stats)
    widths = dict(batch.widths.get(rows, {}))
    return (tokens / t if t > 0 else 0.0), [out.get(k, []) for k in sorted(last)], stats, widths


def _mlx_lm(
    model: Any, tokenizer: Any, ids: list[int], rows: int, cache: list, max_tokens: int
) -> tuple[float, list]:
    from mlx_lm import batch_generate

    r = batch_generate(
        model,
        tokenizer,
        [[ids[-1]] for _ in range(rows)],
        prompt_caches=[cache for _ in range(rows)],  # not updated in place (mlx-lm's doc)
        max_tokens=max_tokens,
        return_token_ids=True,
    )
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    out = [[int(t) for t in toks if int(t) not in eos] for toks in r.token_ids]
    return float(r.stats.generation_tps), out


def run_batch_bench(
    model: Any,
    tokenizer: Any,
    workloads: Sequence[Workload],
    *,
    policy: Policy | str | Sequence[Policy | str] = "copy",
    batches: Sequence[int] = (1, 2, 4, 8),
    runs: int = 3,
    max_tokens: int = 300,
    progress: Any = None,
    on_run: Callable[[str, Workload, int, int], None] | None = None,
) -> list[BatchResult]:
    """Measure ``policy`` (or each of several, side by side) against ``none`` and mlx-lm's
    ``batch_generate`` at each batch size: one result per workload, batch size and policy.

    Raises:
        RequestError: bad arguments (before any model work), or two policies of one name.
        PolicyError: a policy cannot run rows of a batch.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise RequestError(f"runs must be an integer >= 1, got {runs!r}")
    if not batches or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in batches):
        raise RequestError(f"batch sizes must be integers >= 1, got {list(batches)!r}")
    if not workloads:
        raise RequestError("no workloads to run")
    pols = [load_policy(p) for p in ([policy] if isinstance(policy, (Policy, str)) else policy)]
    if not pols or len({p.name for p in pols}) != len(pols):
        raise RequestError(
            f"give one or more policies of different names, got {[p.name for p in pols]}"
        )
    off_pipe = assemble(model, tokenizer, "none")
    on_pipes = [assemble(model, tokenizer, p) for p in pols]
    for pipe in on_pipes:
        pipe.batch(max(batches))  # refuses a policy that cannot batch, before any work
        pipe.prepare(rows=max(batches))  # the batches' cost curves too, before any timing
    pipes = {"off": off_pipe, **{f"on:{p.name}": pp for p, pp in zip(pols, on_pipes)}}
    kinds = ["off", *(f"on:{p.name}" for p in pols), "mlx-lm"]
    results = []
    for w in workloads:
        ids = w.prompt_ids(off_pipe)
        if on_run is not None:
            on_run("alone", w, 0, -1)
        alone = off_pipe.generate(ids, max_tokens=max_tokens).tokens
        cache = _prefilled(model, ids)
        # warm-up: a few tokens of each contender
        for pipe in pipes.values():
            _specdec(pipe, ids, 1, cache, 4)
        _mlx_lm(model, tokenizer, ids, 1, cache, 4)
        for b in batches:
            res = {
                p.name: BatchResult(workload=w.name, batch=b, policy=p.name, prompt_tokens=len(ids))
                for p in pols
            }
            for run in range(runs):
                shift = run % len(kinds)
                for kind in kinds[shift:] + kinds[:shift]:
                    if on_run is not None:
                        on_run(kind, w, b, run)  # "off", "on:POLICY" or "mlx-lm"
                    gc.collect()
                    if kind == "mlx-lm":
                        tps, rows = _mlx_lm(model, tokenizer, ids, b, cache, max_tokens)
                    else:
                        tps, rows, stats, widths = _specdec(pipes[kind], ids, b, cache, max_tokens)
                    same = sum(r == alone for r in rows)
                    if kind.startswith("on:"):
                        r = res[kind[3:]]
                        r.tokens_per_forward.append(
                            statistics.mean(s.tokens_per_forward for s in stats)
                        )
                        r.acceptance.append(statistics.mean(s.acceptance_rate for s in stats))
                        r.cut.append(sum(s.batch_cut for s in stats))
                        for width, n in widths.items():
                            r.widths[width] = r.widths.get(width, 0) + n
                        r.tps.setdefault("on", []).append(tps)
                        r.identical.setdefault("on", []).append(same)
                    else:
                        for r in res.values():  # the same runs for every policy's record
                            r.tps.setdefault(kind, []).append(tps)
                            r.identical.setdefault(kind, []).append(same)
                    if progress is not None:
                        progress.advance()
            results.extend(res.values())
    return results


def batch_steps(n_workloads: int, batches: Sequence[int], runs: int, policies: int = 1) -> int:
    """Progress steps of :func:`run_batch_bench`."""
    return n_workloads * len(batches) * runs * (len(KINDS) - 1 + policies)


def batch_table(results: Sequence[BatchResult]) -> str:
    """The markdown table of a batch bench."""
    lines = [
        "| workload | B | policy | none tok/s | policy tok/s | mlx-lm batch_generate tok/s "
        "| policy / none "
        "| policy / mlx-lm | tok/forward | mean width (tokens cut) "
        "| rows identical (none, policy, mlx-lm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        d = r.record()
        same = d["rows_identical"]
        lines.append(
            f"| {r.workload} | {r.batch} | {r.policy} | {d['off_tps']:.1f} | {d['on_tps']:.1f} "
            f"| {d['mlx_lm_tps']:.1f} | {d['on_vs_off']:.2f}x | {d['on_vs_mlx_lm']:.2f}x "
            f"| {d['tokens_per_forward']:.2f} "
            f"| {d['mean_width'] or 0:.2f} ({d['cut_tokens'] or 0:g}) "
            f"| {same.get('off')}, {same.get('on')}, {same.get('mlx-lm')} |"
        )
    return "\n".join(lines)
