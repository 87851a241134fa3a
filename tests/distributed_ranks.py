"""The program every rank of the two-rank jobs of ``test_distributed.py`` runs.

``mlx.launch --backend ring -n 2 --hosts 127.0.0.1 python distributed_ranks.py SPEC OUT``:
reads the cases from the JSON file SPEC, runs each on the sharded model (every rank
the same request), and writes ``OUT/rank<r>.json`` with each case's tokens, stats,
per-round records and error. The test compares the ranks and the single-process
run. Test components whose behaviour depends on the rank (a drafter that fails or
proposes another block on one rank, an acceptor that fails on one rank) are
registered here.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import specdec  # noqa: I001 - first: binds MLX's CPU matmuls to the fast BLAS
from specdec import Draft
from specdec.acceptors import GreedyAcceptor
from specdec.testing import OracleDrafter, make_tiny_model, plugin_host

RANK = int(os.environ.get("MLX_RANK", "0"))


class RankFaultyDrafter(OracleDrafter):
    """The oracle drafter (a reference continuation), but on rank ``fail_rank`` its
    ``fail_at``-th proposal raises, and on rank ``skew_rank`` every block of two or more
    tokens is one token shorter (another block than rank 0's)."""

    def __init__(
        self,
        reference,
        fail_rank: int = -1,
        fail_at: int = 3,
        skew_rank: int = -1,
        block: int = 4,
        deterministic: bool = False,
    ):
        super().__init__(reference=reference, block=block, name="faulty")
        self.fail_rank, self.fail_at, self.skew_rank = fail_rank, fail_at, skew_rank
        self.deterministic = deterministic

    def session(self, ctx):
        inner = super().session(ctx)
        drafter = self
        calls = {"n": 0}
        plain_propose = inner.propose

        def propose(history, max_len):
            calls["n"] += 1
            if RANK == drafter.fail_rank and calls["n"] == drafter.fail_at:
                raise RuntimeError(f"injected drafter failure on rank {RANK}")
            draft = plain_propose(history, max_len)
            if RANK == drafter.skew_rank and draft is not None and draft.size > 1:
                draft = Draft(tokens=draft.tokens[:-1])
            return draft

        inner.propose = propose
        return inner


class ProbDrafter(OracleDrafter):
    """The oracle drafter (a reference continuation) with draft probabilities: 0.9 on
    the proposed token, the rest spread evenly (``deterministic`` is not set, so on a
    sharded model rank 0's ``q`` is broadcast every round)."""

    def __init__(self, reference, vocab_size: int = 256, block: int = 4):
        super().__init__(reference=reference, block=block, name="prob", vocab_size=vocab_size)

    def session(self, ctx):
        inner = super().session(ctx)
        plain_propose, vocab = inner.propose, self.vocab_size

        def propose(history, max_len):
            draft = plain_propose(history, max_len)
            if draft is None:
                return None
            toks = list(draft.tokens)
            q = mx.full((len(toks), vocab), 0.1 / (vocab - 1))
            q[mx.arange(len(toks)), mx.array(toks)] = 0.9
            return Draft(tokens=toks, probs=q)

        inner.propose = propose
        return inner


class RankFaultyAcceptor(GreedyAcceptor):
    """Greedy acceptance that raises on rank ``fail_rank`` in its ``fail_at``-th round
    (after the verify forward was queued)."""

    name = "faulty_greedy"

    def __init__(self, fail_rank: int = 1, fail_at: int = 3):
        self.fail_rank, self.fail_at, self.calls = fail_rank, fail_at, 0

    def accept(self, block, draft_probs, logits, sampler, positions):
        self.calls += 1
        if RANK == self.fail_rank and self.calls == self.fail_at:
            raise RuntimeError(f"injected acceptor failure on rank {RANK}")
        return super().accept(block, draft_probs, logits, sampler, positions)


class RankTestPlugin:
    """Registers the rank-dependent test components."""

    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("faulty", RankFaultyDrafter)
        register("prob", ProbDrafter)

    @specdec.hookimpl
    def specdec_register_acceptors(self, register):
        register("faulty_greedy", RankFaultyAcceptor)


def _ban_on_rank(rank: int, token: int, after: int):
    """A logits processor that bans ``token`` on one rank once ``after`` tokens exist."""

    def process(tokens, logits):
        if RANK == rank and tokens.shape[-1] >= after:
            logits[..., token] = -1e9
        return logits

    return process


def _raise_on_rank(rank: int, after: int):
    """A logits processor that raises on one rank once ``after`` tokens exist: after
    the round's synchronisation, with its verify forward built but not yet run."""

    def process(tokens, logits):
        if RANK == rank and tokens.shape[-1] >= after:
            raise RuntimeError(f"injected processor failure on rank {RANK}")
        return logits

    return process


def _model(name: str):
    if name == "default":
        return None  # assemble loads (and shards) the built-in default model
    if name == "tiny-qwen2":
        from core_support import make_tiny_qwen2

        return make_tiny_qwen2()
    arch = name.removeprefix("tiny-")
    return make_tiny_model(arch, vocab_size=256)


def run_case(case: dict, pipes: dict) -> dict:
    """One case: build (or reuse) the pipeline, run the request, record everything."""
    key = (case["model"], json.dumps(case["policy"], sort_keys=True), case.get("sharding"))
    if key not in pipes:
        model = _model(case["model"])
        # a path is sharded under a launcher by default; a model object on request
        pipes[key] = specdec.assemble(
            model,
            policy=specdec.load_policy(case["policy"]),
            distributed=None if model is None else True,
            sharding=case.get("sharding", "auto"),
        )
    pipe = pipes[key]
    rounds: list = []

    def on_round(result, caches):
        rounds.append(
            {
                "committed": list(result.committed),
                "n_accepted": result.n_accepted,
                "block": list(result.block),
                "offset": int(getattr(caches[0], "offset", -1)),
            }
        )

    kwargs = dict(
        max_tokens=case["max_tokens"],
        temperature=case.get("temperature", 0.0),
        seed=case.get("seed"),
    )
    if case.get("record_rounds"):
        kwargs["on_round"] = on_round
    ban = case.get("ban")
    if ban:
        kwargs["logits_processors"] = [_ban_on_rank(*ban)]
    if case.get("raise"):
        kwargs["logits_processors"] = [_raise_on_rank(*case["raise"])]
    out: dict = {"tokens": [], "error": None, "error_type": None, "rounds": rounds}
    t0 = time.perf_counter()
    try:
        stream = pipe.stream(case["prompt"], **kwargs)
        for i, r in enumerate(stream):
            if not r.is_stop_token:
                out["tokens"].append(r.token)
            if r.stats is not None:
                out["stats"] = r.stats.to_dict()
            if case.get("close_on_rank") == RANK and i + 1 == case.get("close_after", 3):
                stream.close()
                break
    except Exception as exc:  # recorded: the test asserts what each rank raised
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["error_type"] = type(exc).__name__
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dest = Path(sys.argv[2])
    results: dict = {"rank": RANK, "cases": {}}
    world = specdec.distributed.launched_world()
    results["ranks"] = 0 if world is None else world.size()
    pipes: dict = {}
    with plugin_host(RankTestPlugin()):
        for case in spec["cases"]:
            results["cases"][case["name"]] = run_case(case, pipes)
            # written after every case: a test that times out still sees how far it got
            (dest / f"rank{RANK}.json").write_text(json.dumps(results))
    # every rank is still in step after the failures: one last collective
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=world))
    results["done"] = True
    (dest / f"rank{RANK}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
