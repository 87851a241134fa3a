"""What a transaction keeps between rounds: nothing.

Every strategy records into arrays of the verify forward itself (captured states,
the tape, the layer inputs); a commit or an abort drops them, so no memory is
carried from one round to the next and MLX's allocator reuses the same buffers
round after round. Records follow the forward's dtype, shape and device because
they are made by it, every round afresh.
"""

from __future__ import annotations

import copy
import gc

import mlx.core as mx
import pytest
import specdec
from gdn_support import NGRAM, copy_model, copy_prompt
from specdec_qwen_mtp_gdn import STRATEGIES


def _policy(strategy):
    return specdec.Policy(
        name=f"ngram-{strategy}",
        drafters=NGRAM.drafters,
        rollback="gdn_transaction",
        # NGRAM's ladder sizing: how many rounds draft must not depend on the machine's
        # timing (the cost sizing once drafted in 2 rounds of 48 tokens under load)
        options={**NGRAM.options, "gdn_transaction": {"strategy": strategy}},
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_memory_is_carried_across_rounds(strategy):
    model = copy_model("qwen3_next")
    prompt = list(copy_prompt("qwen3_next"))
    pipe = specdec.assemble(model, policy=_policy(strategy))
    pipe.generate(prompt, max_tokens=8)  # warm the allocator
    active, drafted_rounds = [], []

    def rec(result, caches):
        gc.collect()
        mx.eval([c.state for c in caches])
        active.append(mx.get_active_memory())
        drafted_rounds.append(bool(result.block))

    out = pipe.generate(prompt, max_tokens=48, on_round=rec)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert f"gdn_transaction:{strategy}" in out.stats.rollbacks
    assert sum(drafted_rounds) >= 3
    # The caches grow by the attention layer's KV entries only (one small step per
    # 256 tokens in mlx-lm's KVCache); what the transaction recorded is gone after
    # each commit, so active memory after the rounds of the second half of the
    # request is the same as after its first rounds, within one KV step.
    kv_step = 256 * 2 * 2 * 16 * 4 * 2  # 256 positions x (K, V) x 2 heads x 16 dims x f32 x margin
    assert max(active) - min(active) <= kv_step, (min(active), max(active))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_records_follow_the_model_dtype(strategy):
    """A bfloat16 copy of the model: records are made by its forward, in its dtype."""
    from mlx.utils import tree_map

    model = copy_model("qwen3_next")
    half = copy.deepcopy(model)
    half.update(tree_map(lambda p: p.astype(mx.bfloat16), half.parameters()))
    prompt = list(copy_prompt("qwen3_next"))
    for m in (model, half, model):  # back and forth: nothing cached from the other
        plain = specdec.assemble(m, policy="none").generate(prompt, max_tokens=16)
        spec = specdec.assemble(m, policy=_policy(strategy)).generate(prompt, max_tokens=16)
        assert spec.stats.drafted > 0
        assert spec.tokens == plain.tokens
