"""What a ``gdn_transaction`` commit costs, as a fraction of the verify forward it follows.

For a benchmark (``specdec bench``) or by hand::

    python -m specdec_qwen_mtp_gdn --block 4 8 16    # tiny qwen3_next, JSON lines

Each round feeds ``[last, *block]`` (``block`` tokens plus one) through the model
inside a transaction over the whole cache list, then commits a partial
acceptance (the case that needs work: a full acceptance keeps everything). The
verify time includes evaluating the logits and every cache; the commit time is
``commit`` plus evaluating the rebuilt caches, so nothing of the forward is
counted twice.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from specdec.rollback import KVTrimRollback, RollbackPlan, RotatingWindowRollback

from .rollback import STRATEGIES, GatedDeltaRollback


@attrs.frozen
class CommitCost:
    """Commit cost of one strategy (medians over the measured rounds).

    Attributes:
        strategy: ``capture``, ``tape`` or ``rerun``.
        n_fed: tokens per verify forward (``block + 1``).
        rounds: rounds measured.
        verify_ms: the verify forward, with recording armed.
        plain_verify_ms: the same forward with no transaction armed.
        commit_ms: the commit of a partial acceptance over the whole cache list.
        fraction: median over rounds of commit time / verify time.
        record_overhead: median over rounds of armed / plain verify time, minus 1 (what
            recording adds to the forward).
    """

    strategy: str
    n_fed: int
    rounds: int
    verify_ms: float
    plain_verify_ms: float
    commit_ms: float
    fraction: float
    record_overhead: float

    def to_dict(self) -> dict:
        """A JSON-able dict."""
        return attrs.asdict(self)


def _states(caches: list) -> list:
    return [c.state for c in caches]


def _prefilled(model: Any, prompt: Sequence[int]) -> list:
    caches = make_prompt_cache(model)
    model(mx.array(list(prompt))[None], cache=caches)
    mx.eval(_states(caches))
    return caches


def _plain_forward(model: Any, x: mx.array, caches: list) -> float:
    """The verify forward with nothing armed, rolled back by hand afterwards; its time."""
    snapshot = [list(c.cache) if hasattr(c, "cache") else c.offset for c in caches]
    t0 = time.perf_counter()
    mx.eval(model(x, cache=caches), _states(caches))
    t1 = time.perf_counter()
    for c, s in zip(caches, snapshot):
        if hasattr(c, "cache"):
            c.cache = s
        else:
            c.trim(c.offset - s)
    return t1 - t0


def _verify_and_commit(
    model: Any, x: mx.array, caches: list, plan: RollbackPlan, keep: int
) -> tuple[float, float]:
    """One transaction: the armed verify forward's time and the commit's."""
    txn = plan.begin()
    t0 = time.perf_counter()
    mx.eval(model(x, cache=caches), _states(caches))
    t1 = time.perf_counter()
    txn.commit(x.shape[1], keep)
    mx.eval(_states(caches))
    return t1 - t0, time.perf_counter() - t1


def measure_commit_cost(
    model: Any = None,
    *,
    strategies: Sequence[str] = STRATEGIES,
    block: int = 8,
    rounds: int = 20,
    warmup: int = 3,
    prompt_tokens: Sequence[int] | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
) -> list[CommitCost]:
    """Time verify forwards and ``gdn_transaction`` commits for each strategy.

    Args:
        model: an mlx-lm hybrid model (default: ``make_tiny_hybrid("qwen3_next")``).
        strategies: strategies to measure.
        block: drafted tokens per round (``n_fed = block + 1``).
        rounds: measured rounds per strategy (after ``warmup`` unmeasured ones).
        warmup: rounds run first and not measured (compilation, allocation).
        prompt_tokens: the context before the first round (default: 64 random tokens).
        vocab_size: token ids are drawn below this (default: the model's, else 64).
        seed: seeds the random blocks and acceptance lengths.

    Returns:
        one :class:`CommitCost` per strategy, in the order given.
    """
    if model is None:
        from .tiny import make_tiny_hybrid

        model = make_tiny_hybrid("qwen3_next")
    if vocab_size is None:
        args = getattr(model, "args", None)
        vocab_size = getattr(args, "vocab_size", None) or 64
    rng = random.Random(seed)
    if prompt_tokens is None:
        prompt_tokens = [rng.randrange(vocab_size) for _ in range(64)]
    n_fed = block + 1
    plan_rounds = [
        ([rng.randrange(vocab_size) for _ in range(n_fed)], rng.randrange(1, n_fed))
        for _ in range(warmup + rounds)
    ]
    out = []
    for strategy in strategies:
        caches = _prefilled(model, prompt_tokens)
        gdn = GatedDeltaRollback(strategy=strategy)
        plan = RollbackPlan(caches, [gdn, KVTrimRollback(), RotatingWindowRollback()], model=model)
        if not plan.ok:
            raise ValueError(f"model caches cannot all be rolled back: {plan.reason}")
        verify, plain, commit = [], [], []
        for i, (tokens, keep) in enumerate(plan_rounds):
            x = mx.array(tokens)[None]
            # alternate the order: whichever forward runs second is a little faster or slower
            if i % 2:
                tv, tc = _verify_and_commit(model, x, caches, plan, keep)
                tp = _plain_forward(model, x, caches)
            else:
                tp = _plain_forward(model, x, caches)
                tv, tc = _verify_and_commit(model, x, caches, plan, keep)
            if i >= warmup:
                plain.append(tp)
                verify.append(tv)
                commit.append(tc)
        v, p, c = (statistics.median(xs) * 1e3 for xs in (verify, plain, commit))
        # per-round ratios: a round slowed by other work on the machine slows both parts
        out.append(
            CommitCost(
                strategy=strategy,
                n_fed=n_fed,
                rounds=rounds,
                verify_ms=v,
                plain_verify_ms=p,
                commit_ms=c,
                fraction=statistics.median(ci / vi for ci, vi in zip(commit, verify)),
                record_overhead=statistics.median(vi / pi for vi, pi in zip(verify, plain)) - 1,
            )
        )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Print one JSON line per strategy and block size (``--block 4 8 16``, ``--arch``)."""
    import argparse

    from .tiny import HYBRID_ARCHITECTURES, make_tiny_hybrid

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_next", choices=HYBRID_ARCHITECTURES)
    ap.add_argument("--block", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--strategy", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    a = ap.parse_args(argv)
    model = make_tiny_hybrid(a.arch)
    for b in a.block:
        for cost in measure_commit_cost(model, strategies=a.strategy, block=b, rounds=a.rounds):
            print(json.dumps({"arch": a.arch, **cost.to_dict()}))


if __name__ == "__main__":  # pragma: no cover
    main()
