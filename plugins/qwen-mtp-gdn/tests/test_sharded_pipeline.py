"""A tiny Qwen3-Next split into a two-rank pipeline (mlx-lm's ``pipeline(group)``, the
only split mlx-lm has for it), speculating with ``ngram_copy`` and rolled back by
``gdn_transaction``: every strategy's output equals the single-process plain run, on
both ranks, round by round, with drafts accepted."""

from __future__ import annotations

import json
import sys

import specdec
from gdn_support import copy_model, copy_prompt
from specdec.testing import run_ranks
from specdec_qwen_mtp_gdn import STRATEGIES

ARCH = "qwen3_next"
MAX_TOKENS = 24

#: What every rank runs: the model each test process builds (the same seeded weights),
#: split into a pipeline, then one request per strategy; results in rank<r>.json.
RANK_PROGRAM = """
import specdec  # first: binds MLX's CPU matmuls to the fast BLAS
import json, os, sys
from specdec_qwen_mtp_gdn.tiny import make_tiny_hybrid

spec = json.loads(open(sys.argv[1]).read())
model = make_tiny_hybrid(spec["arch"], mixing=0.2, seed=0)
out = {}
for strategy in spec["strategies"]:
    policy = specdec.Policy(
        name="ngram-" + strategy,
        drafters=("ngram_copy",),
        rollback="gdn_transaction",
        options={"gdn_transaction": {"strategy": strategy}},
    )
    pipe = specdec.assemble(model, policy=policy, distributed=True, sharding="pipeline")
    rounds = []
    res = pipe.generate(
        spec["prompt"],
        max_tokens=spec["max_tokens"],
        on_round=lambda r, caches: rounds.append([list(r.committed), r.n_accepted]),
    )
    out[strategy] = {
        "tokens": res.tokens,
        "rounds": rounds,
        "stats": res.stats.to_dict(),
    }
rank = os.environ["MLX_RANK"]
open(os.path.join(os.path.dirname(sys.argv[1]), f"rank{rank}.json"), "w").write(json.dumps(out))
"""


def test_pipelined_hybrid_speculates_exactly(tmp_path):
    prompt = list(copy_prompt(ARCH))
    want = specdec.assemble(copy_model(ARCH), policy="none").generate(prompt, max_tokens=MAX_TOKENS)
    spec = tmp_path / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "arch": ARCH,
                "strategies": list(STRATEGIES),
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
            }
        )
    )
    program = tmp_path / "rank_program.py"
    program.write_text(RANK_PROGRAM)
    run_ranks([sys.executable, str(program), str(spec)], tmp_path, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for strategy in STRATEGIES:
        a, b = ranks[0][strategy], ranks[1][strategy]
        assert a["rounds"] == b["rounds"], f"{strategy}: the ranks' rounds differ"
        # a pipeline adds no partial sums: exactly the single-process plain output
        assert a["tokens"] == b["tokens"] == want.tokens, strategy
        assert a["stats"]["accepted"] > 0, f"{strategy}: no draft was accepted"
        d = a["stats"]["distributed"]
        assert (d["kind"], d["ranks"]) == ("pipeline", 2)
        assert a["stats"]["rollbacks"], "no rollback served the caches"
        assert any(r.startswith("gdn_transaction") for r in a["stats"]["rollbacks"])
    # the two ranks hold different layers
    assert (
        ranks[0][STRATEGIES[0]]["stats"]["distributed"]["layers"]
        != (ranks[1][STRATEGIES[0]]["stats"]["distributed"]["layers"])
    )
