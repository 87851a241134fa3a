"""After a commit, GDN conv and recurrent state equal those of feeding only the accepted prefix."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.models import cache as C
from mlx_lm.models import gated_delta, qwen3_next
from specdec.rollback import KVTrimRollback, RollbackPlan
from specdec_qwen_mtp_gdn import (
    STRATEGIES,
    CaptureError,
    GatedDeltaRollback,
    make_tiny_hybrid,
    recording,
)
from specdec_qwen_mtp_gdn.recording import ARMED, ops_with_states

HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
PROMPT = [3, 17, 42, 9, 28, 5, 61, 11, 4, 4, 19, 33]
BLOCK = [7, 0, 9, 0, 11, 50]  # 0 doubles as a PAD id: generated tokens are ordinary inputs
ATOL = 1e-5  # float32 state
LOGIT_ATOL = 1e-4  # logits reach |14|: 1e-4 is 7e-6 relative


def feed(model, caches, tokens):
    return model(mx.array(list(tokens))[None], cache=caches)


def prefilled(model, tokens=PROMPT):
    caches = C.make_prompt_cache(model)
    feed(model, caches, tokens)
    mx.eval([c.state for c in caches])
    return caches


def plan_for(model, caches, strategy):
    plan = RollbackPlan(caches, [GatedDeltaRollback(strategy), KVTrimRollback()], model=model)
    assert plan.ok, plan.reason
    return plan


def max_diff(ref, ours):
    """Largest |difference| over every GDN conv/recurrent state and attention K/V in view."""
    worst = 0.0
    for a, b in zip(ref, ours):
        if type(a) is C.ArraysCache:
            pairs = list(zip(a.cache, b.cache))
        else:
            assert a.offset == b.offset
            o = a.offset
            pairs = [
                (a.keys[..., :o, :], b.keys[..., :o, :]),
                (a.values[..., :o, :], b.values[..., :o, :]),
            ]
        for x, y in pairs:
            assert (x is None) == (y is None)
            if x is not None:
                assert x.shape == y.shape and x.dtype == y.dtype
                worst = max(worst, float(mx.abs(x - y).max()))
    return worst


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_commit_equals_feeding_only_the_prefix(arch, strategy):
    """Every accepted length 0..k: state and next-token logits as if only the prefix was fed.

    The references feed the prefix as one block and token by token (as plain decoding
    does). Matmuls over a different number of rows may round differently (OpenBLAS),
    so the figure is not always 0; the commit itself adds no error.
    """
    model = make_tiny_hybrid(arch)
    state_diff = logit_diff = 0.0
    for keep in range(len(BLOCK) + 1):
        ref = prefilled(model)
        stepwise = prefilled(model)
        if keep:
            feed(model, ref, BLOCK[:keep])
            for t in BLOCK[:keep]:
                feed(model, stepwise, [t])
        ours = prefilled(model)
        txn = plan_for(model, ours, strategy).begin()
        feed(model, ours, BLOCK)
        txn.commit(len(BLOCK), keep)
        mx.eval([c.state for c in ours])
        assert not any(hasattr(c, ARMED) for c in ours)
        state_diff = max(state_diff, max_diff(ref, ours), max_diff(stepwise, ours))
        nxt = [int(BLOCK[keep % len(BLOCK)])]
        la, lb, lc = feed(model, ref, nxt), feed(model, ours, nxt), feed(model, stepwise, nxt)
        logit_diff = max(logit_diff, float(mx.abs(la - lb).max()), float(mx.abs(lc - lb).max()))
        assert int(mx.argmax(la[0, -1])) == int(mx.argmax(lb[0, -1])) == int(mx.argmax(lc[0, -1]))
        state_diff = max(state_diff, max_diff(ref, ours))  # and they keep evolving alike
    print(f"\n{arch}/{strategy}: state max abs diff {state_diff:.3g}, logits {logit_diff:.3g}")
    assert state_diff <= ATOL, f"{arch}/{strategy}: state max abs difference {state_diff:.3g}"
    assert logit_diff <= LOGIT_ATOL, (
        f"{arch}/{strategy}: logits max abs difference {logit_diff:.3g}"
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_commit_after_several_forwards_in_one_transaction(strategy):
    """As a drafter's own cache is fed: a few tokens per forward, one commit at the end."""
    model = make_tiny_hybrid("qwen3_5")
    chunks = [BLOCK[:2], BLOCK[2:3], BLOCK[3:]]
    for keep in range(len(BLOCK) + 1):
        ref = prefilled(model)
        if keep:
            feed(model, ref, BLOCK[:keep])
        ours = prefilled(model)
        txn = plan_for(model, ours, strategy).begin()
        for chunk in chunks:
            feed(model, ours, chunk)
        txn.commit(len(BLOCK), keep)
        assert max_diff(ref, ours) <= ATOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_first_round_on_empty_caches(strategy):
    """A one-token prompt is not prefilled: the first verify starts from empty GDN caches."""
    model = make_tiny_hybrid("qwen3_next")
    for keep in (0, 1, 3):
        ref = C.make_prompt_cache(model)
        if keep:
            feed(model, ref, BLOCK[:keep])
        ours = C.make_prompt_cache(model)
        txn = plan_for(model, ours, strategy).begin()
        feed(model, ours, BLOCK[:4])
        txn.commit(4, keep)
        if keep == 0:
            assert all(x is None for c in ours if type(c) is C.ArraysCache for x in c.cache)
        else:
            assert max_diff(ref, ours) <= ATOL


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_abort_restores_exactly(strategy):
    model = make_tiny_hybrid("qwen3_next")
    caches = prefilled(model)
    before = [list(c.cache) if type(c) is C.ArraysCache else c.offset for c in caches]
    txn = plan_for(model, caches, strategy).begin()
    feed(model, caches, BLOCK)
    feed(model, caches, [1])
    txn.abort()
    for c, b in zip(caches, before):
        if type(c) is C.ArraysCache:
            assert all(x is y for x, y in zip(c.cache, b))  # the very same arrays
            assert not hasattr(c, ARMED)
        else:
            assert c.offset == b


def test_a_wrong_rollback_is_visible():
    """The comparison above can fail: keeping every fed token differs from keeping a prefix."""
    model = make_tiny_hybrid("qwen3_next")
    ref = prefilled(model)
    feed(model, ref, BLOCK[:2])
    ours = prefilled(model)
    txn = plan_for(model, ours, "capture").begin()
    feed(model, ours, BLOCK)
    txn.commit(len(BLOCK), len(BLOCK))  # as if all were accepted
    for c in ours:
        if type(c) is C.KVCache:
            c.trim(len(BLOCK) - 2)  # attention trimmed right, GDN state not
    gdn = [(a, b) for a, b in zip(ref, ours) if type(a) is C.ArraysCache]
    assert max(float(mx.abs(x - y).max()) for a, b in gdn for x, y in zip(a.cache, b.cache)) > 1e-2


@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_capture_loop_is_mlx_lm_ops_recurrence_bit_for_bit(vector_gate, masked):
    """``ops_with_states`` returns exactly ``gated_delta_ops``'s ``y`` and final state."""
    mx.random.seed(3)
    B, T, Hk, Hv, Dk, Dv = 1, 5, 2, 4, 32, 16
    q, k = mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk))
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv, Dk) if vector_gate else (B, T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk))
    mask = mx.array([[True, True, False, True, True]]) if masked else None
    original = recording._original(gated_delta.gated_delta_ops)
    y0, s0 = original(q, k, v, g, beta, state, mask)
    y1, s1, states = ops_with_states(q, k, v, g, beta, state, mask)
    assert mx.array_equal(y0, y1) and mx.array_equal(s0, s1) and mx.array_equal(states[-1], s1)
    for t in range(T):  # the state after step t is the state after feeding t + 1 steps
        _, st = original(
            q[:, : t + 1],
            k[:, : t + 1],
            v[:, : t + 1],
            g[:, : t + 1],
            beta[:, : t + 1],
            state,
            None if mask is None else mask[:, : t + 1],
        )
        assert mx.array_equal(states[t], st)


def test_wrappers_are_a_no_op_when_nothing_is_armed():
    model = make_tiny_hybrid("qwen3_next")
    plan_for(model, C.make_prompt_cache(model), "capture")  # installs the wrappers
    assert "mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet" in recording.installed()["classes"]
    with_hooks = prefilled(model)
    out_hooks = feed(model, with_hooks, BLOCK)
    recording.uninstall()
    try:
        assert recording.installed() == {"classes": [], "functions": []}
        assert "_specdec_gdn_original" not in vars(qwen3_next.Qwen3NextGatedDeltaNet.__call__)
        bare = prefilled(model)
        out_bare = feed(model, bare, BLOCK)
        assert mx.array_equal(out_hooks, out_bare)
        assert max_diff(bare, with_hooks) == 0.0
    finally:
        plan_for(model, C.make_prompt_cache(model), "capture")


def test_subclass_of_a_wrapped_class_is_not_wrapped_twice():
    class Sub(qwen3_next.Qwen3NextGatedDeltaNet):
        pass

    recording.install([qwen3_next.Qwen3NextGatedDeltaNet, Sub])
    call = qwen3_next.Qwen3NextGatedDeltaNet.__call__
    assert Sub.__call__ is call
    assert not hasattr(call._specdec_gdn_original, "_specdec_gdn_original")


def test_commit_with_a_wrong_token_count_fails_loudly():
    model = make_tiny_hybrid("qwen3_next")
    caches = prefilled(model)
    txn = plan_for(model, caches, "capture").begin()
    feed(model, caches, BLOCK)
    with pytest.raises(CaptureError, match="commit says 7"):
        txn.commit(len(BLOCK) + 1, 2)
    txn.abort()
    assert max_diff(prefilled(model), caches) == 0.0


@pytest.mark.parametrize("strategy", ["capture", "tape"])
def test_a_recurrence_that_bypasses_the_wrappers_fails_loudly(monkeypatch, strategy):
    """If mlx-lm stops calling gated_delta_ops/kernel, capture and tape refuse to commit."""
    model = make_tiny_hybrid("qwen3_next")
    original_ops = recording._original(gated_delta.gated_delta_ops)

    def private_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        beta = mx.sigmoid(b)
        g = gated_delta.compute_g(A_log, a, dt_bias)
        return original_ops(q, k, v, g, beta, state, mask)

    monkeypatch.setattr(qwen3_next, "gated_delta_update", private_update)
    caches = prefilled(model)
    txn = plan_for(model, caches, strategy).begin()
    with pytest.raises(CaptureError, match="recurrence 0 times"):
        feed(model, caches, BLOCK)
    txn.abort()
    assert max_diff(prefilled(model), caches) == 0.0


def test_rerun_needs_only_the_layer_call(monkeypatch):
    """``rerun`` does not depend on the recurrence's internals."""
    model = make_tiny_hybrid("qwen3_next")
    original_ops = recording._original(gated_delta.gated_delta_ops)

    def private_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        return original_ops(
            q, k, v, gated_delta.compute_g(A_log, a, dt_bias), mx.sigmoid(b), state, mask
        )

    monkeypatch.setattr(qwen3_next, "gated_delta_update", private_update)
    ref = prefilled(model)
    feed(model, ref, BLOCK[:3])
    ours = prefilled(model)
    txn = plan_for(model, ours, "rerun").begin()
    feed(model, ours, BLOCK)
    txn.commit(len(BLOCK), 3)
    assert max_diff(ref, ours) <= ATOL


def test_caches_without_a_model_or_without_gdn_layers_are_not_claimed():
    model = make_tiny_hybrid("qwen3_next")
    caches = C.make_prompt_cache(model)
    gdn = GatedDeltaRollback()
    assert not RollbackPlan(caches, [gdn, KVTrimRollback()]).ok  # no model: not claimed
    assert not gdn.supports(caches[0])
    other = C.ArraysCache(2)  # e.g. a Mamba layer's conv + ssm state
    plan = RollbackPlan([*caches[:-1], other], [gdn, KVTrimRollback()], model=model)
    assert not plan.ok  # the last layer is attention in the model: its cache is not GDN
    padded = C.make_prompt_cache(model)
    padded[0].left_padding = mx.array([2])
    assert RollbackPlan(padded, [gdn, KVTrimRollback()], model=model).missing == [
        "ArraysCache (layer 0)"
    ]


def test_an_arrays_cache_model_without_gdn_layers_runs_plain_with_a_reason():
    model = make_tiny_hybrid("qwen3_next")

    class MambaLike:
        """The hybrid with one extra ArraysCache layer that is not a GDN layer."""

        def __init__(self, inner):
            self.inner, self.args = inner, inner.args
            self.layers = [*inner.layers, object()]

        def make_cache(self):
            return [*C.make_prompt_cache(self.inner), C.ArraysCache(2)]

        def __call__(self, x, cache):
            return self.inner(x, cache=cache[:-1])

    out = specdec.assemble(MambaLike(model), policy="copy").generate(PROMPT * 3, max_tokens=6)
    assert out.stats.drafted == 0
    assert "ArraysCache (layer 4)" in out.stats.speculation_off_reason


def test_states_are_float32_like_plain_decoding():
    model = make_tiny_hybrid("qwen3_next")
    caches = prefilled(model)
    txn = plan_for(model, caches, "capture").begin()
    feed(model, caches, BLOCK)
    txn.commit(len(BLOCK), 2)
    conv, state = caches[0].cache
    assert state.dtype == mx.float32 and conv.dtype == mx.float32
    assert np.isfinite(np.array(state)).all()


@pytest.mark.parametrize("strategy", ["capture", "tape"])
def test_kernel_path_logic_with_a_stand_in_kernel(monkeypatch, strategy):
    """The Metal kernel path (no Metal here): a stand-in kernel with the ops semantics is
    captured one step at a time (capture) or replayed on the prefix (tape)."""
    model = make_tiny_hybrid("qwen3_next")
    original_ops = recording._original(gated_delta.gated_delta_ops)
    calls = []

    def stand_in_kernel(q, k, v, g, beta, state, mask=None):
        calls.append(q.shape[1])
        return original_ops(q, k, v, g, beta, state, mask)

    monkeypatch.setattr(
        gated_delta, "gated_delta_kernel", recording._wrap_leaf("kernel", stand_in_kernel)
    )

    def kernel_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, **kw):
        g = gated_delta.compute_g(A_log, a, dt_bias)
        return gated_delta.gated_delta_kernel(q, k, v, g, mx.sigmoid(b), state, mask)

    monkeypatch.setattr(qwen3_next, "gated_delta_update", kernel_update)
    for keep in (1, 3, len(BLOCK) - 1):
        ref = prefilled(model)
        feed(model, ref, BLOCK[:keep])
        ours = prefilled(model)
        calls.clear()
        txn = plan_for(model, ours, strategy).begin()
        feed(model, ours, BLOCK)
        # capture: one launch per token and GDN layer; tape: one launch per GDN layer
        assert set(calls) == ({1} if strategy == "capture" else {len(BLOCK)})
        txn.commit(len(BLOCK), keep)
        mx.eval([c.state for c in ours])
        assert max_diff(ref, ours) <= ATOL
