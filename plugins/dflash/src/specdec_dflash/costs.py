"""``python -m specdec_dflash costs``: what one DFlash draft forward costs against one
target step, for several block sizes (interleaved medians in one run)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import specdec
from specdec.heads import output_layer

from .checkpoint import load_dflash
from .drafter import embeddings
from .model import DFlashModel


def _time_ms(fn: Callable[[], Any], times: list) -> None:
    t0 = time.perf_counter()
    mx.eval(fn())
    times.append((time.perf_counter() - t0) * 1e3)


def measure_step_costs(
    model: Any,
    module: DFlashModel,
    *,
    context: int = 512,
    blocks: Sequence[int] = (4, 8, 16),
    reps: int = 10,
    seed: int = 0,
) -> dict:
    """Interleaved medians (ms) of a target step (one token, ``context`` tokens cached)
    and of a draft round for each block size: the block's forward over the draft's
    context cache (``context`` entries) and the target's output layer over its
    ``block - 1`` draft rows, as :class:`specdec_dflash.drafter.DFlashSession` drafts.

    Returns:
        ``{"ms", "fraction_of_target_step", "context", "reps", "draft_layers"}``.
    """
    from mlx_lm.models.cache import make_prompt_cache

    rng = random.Random(seed)
    c = module.config
    prompt = [rng.randrange(c.vocab_size) for _ in range(context)]
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=caches))
    plan = specdec.rollback_plan(caches, model=model)
    feats = mx.random.normal((1, context, len(c.target_layer_ids) * c.hidden_size))
    draft_caches = module.make_cache()
    module.append_context(feats, 0, draft_caches)
    mx.eval([dc.state for dc in draft_caches])
    embed = embeddings(model)
    head = output_layer(model)
    tok = mx.array([[prompt[-1]]])

    def step() -> Any:
        txn = plan.begin()
        y = model(tok, cache=caches)
        mx.eval(y)
        txn.commit(1, 0)
        return y

    def draft(b: int) -> Callable[[], Any]:
        ids = mx.array([prompt[-1]] + [c.mask_token_id] * (b - 1))

        def run() -> Any:
            hidden = module(embed(ids)[None], context, draft_caches)[0, 1:]
            return head.logits(hidden)

        return run

    jobs: dict[str, Callable[[], Any]] = {"target_step": step}
    for b in blocks:
        jobs[f"draft_block_{b}"] = draft(b)
    for fn in jobs.values():  # warm up
        mx.eval(fn())
    times: dict[str, list] = {k: [] for k in jobs}
    for _ in range(reps):
        for k, fn in jobs.items():
            _time_ms(fn, times[k])
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    base = med["target_step"]
    return {
        "ms": med,
        "fraction_of_target_step": {k: round(v / base, 3) for k, v in med.items()},
        "context": context,
        "reps": reps,
        "draft_layers": c.num_hidden_layers,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specdec_dflash costs ...``: print the measurement as JSON."""
    p = argparse.ArgumentParser(prog="python -m specdec_dflash costs")
    p.add_argument("--model", default=None, help="target model folder (default: the default model)")
    p.add_argument("--path", required=True, help="the DFlash drafter's folder")
    p.add_argument("--context", type=int, default=512, help="tokens of context (default: 512)")
    p.add_argument(
        "--blocks", default="4,8,16", help="block sizes, comma-separated (default: 4,8,16)"
    )
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (default: 10)")
    args = p.parse_args(argv)
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        p.error(f"--blocks {args.blocks!r}: give block sizes, comma-separated")
    if any(b < 2 for b in blocks) or args.context < 1 or args.reps < 1:
        p.error("block sizes must be >= 2, --context and --reps >= 1")
    try:
        model = specdec.assemble(args.model, policy="none").model
        module, _ = load_dflash(args.path, model)
    except specdec.SpecdecError as exc:
        p.exit(2, f"python -m specdec_dflash costs: error: {exc}\n")
    res = measure_step_costs(model, module, context=args.context, blocks=blocks, reps=args.reps)
    print(json.dumps(res, indent=1))
    return 0
