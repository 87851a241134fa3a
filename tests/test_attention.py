"""The CPU's verify attention: MLX's own result, bit for bit, only where it applies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import oracle_policy
from specdec import attention
from specdec.costs import model_fingerprint


@pytest.fixture
def fresh_attention(monkeypatch):
    """The first-use check runs again in the test, and MLX gets its function back after."""
    attention._reset_for_tests()
    yield
    attention._reset_for_tests()


def _qkv(seed, B, n_q, n_kv, L, S, D=16):
    ks = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((B, n_q, L, D), key=ks[0]) * 2,
        mx.random.normal((B, n_kv, S, D), key=ks[1]),
        mx.random.normal((B, n_kv, S, D), key=ks[2]),
    )


def _mask(kind, B, n_q, L, S, seed):
    key = mx.random.key(seed + 100)
    if kind == "bool-2d":
        return mx.random.uniform(shape=(L, S), key=key) > 0.25
    if kind == "bool-4d":
        return mx.random.uniform(shape=(B, 1, L, S), key=key) > 0.25
    if kind == "additive-f32":
        return mx.where(mx.random.uniform(shape=(L, S), key=key) > 0.25, 0.0, -1e9)
    if kind == "bool-3d-heads":
        return mx.random.uniform(shape=(n_q, L, S), key=key) > 0.25
    if kind == "additive-f16":
        m = mx.where(mx.random.uniform(shape=(B, n_q, L, S), key=key) > 0.25, 0.0, -3e4)
        return m.astype(mx.float16)
    return kind  # None or "causal"


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (9, 3), (8, 1)])
@pytest.mark.parametrize("L,S", [(2, 2), (5, 40), (17, 300), (33, 33)])
@pytest.mark.parametrize(
    "mask", [None, "causal", "bool-2d", "bool-4d", "additive-f32", "additive-f16"]
)
def test_replica_is_bit_identical_to_mlx(heads, L, S, mask):
    n_q, n_kv = heads
    B = 2 if mask == "bool-4d" else 1
    q, k, v = _qkv(L * 31 + S, B, n_q, n_kv, L, S)
    m = _mask(mask, B, n_q, L, S, L + S)
    want = attention._original_or_mlx()
    expected = np.array(want(q, k, v, scale=0.3, mask=m))
    got = np.array(attention.replica_attention(q, k, v, 0.3, m))
    assert got.dtype == np.float32
    assert np.array_equal(got, expected), np.abs(got - expected).max()


@pytest.mark.parametrize("heads", [(6, 2), (9, 3), (8, 8)])
@pytest.mark.parametrize(
    "mask",
    [None, "causal", "bool-2d", "bool-4d", "bool-3d-heads", "additive-f32", "additive-f16"],
)
def test_sliced_replica_is_bit_identical_to_mlx(heads, mask):
    # slices of one and of two K/V heads (the last one shorter), and one piece
    n_q, n_kv = heads
    B, L, S = 2, 9, 70
    q, k, v = _qkv(n_q + n_kv, B, n_q, n_kv, L, S)
    m = _mask(mask, B, n_q, L, S, n_q)
    expected = np.array(attention._original_or_mlx()(q, k, v, scale=0.3, mask=m))
    per_head = B * (n_q // n_kv) * L * S
    for limit in (per_head, 2 * per_head, n_kv * per_head):
        got = attention.sliced_replica_attention(q, k, v, 0.3, m, max_scores=limit)
        assert np.array_equal(np.array(got), expected), (limit, mask)


def test_softmax_replica_matches_mlx_at_the_edges():
    # rows with large spreads (exp underflows to 0 below -88), ties and a whole masked tail
    x = mx.array(
        [
            [0.0, -87.9, -88.1, -200.0, 3.0, 3.0, -1e-7, 1e-7],
            [float(np.finfo(np.float32).min)] * 4 + [1.0, 2.0, 3.0, 4.0],
            [50.0, -50.0, 25.0, 0.5, 0.25, 0.125, -0.0, 0.0],
        ],
        dtype=mx.float32,
    )
    assert np.array_equal(
        np.array(attention._softmax(x)), np.array(mx.softmax(x, axis=-1, precise=True))
    )


def test_status_enables_the_replica_on_this_cpu(fresh_attention, monkeypatch):
    monkeypatch.setenv(attention.ENV, "on")  # bit-identical is all it takes, untimed
    st = attention.status()
    assert st.enabled, st.reason  # CI runs the Linux mlx-cpu wheel: the bits agree
    assert "bit-identical" in st.reason and st.speedup is None
    assert mx.fast.scaled_dot_product_attention is attention._dispatch


def test_status_without_the_env_var_keeps_the_faster_one(fresh_attention, monkeypatch):
    monkeypatch.delenv(attention.ENV, raising=False)
    st = attention.status()
    # Which one wins depends on the machine's load; the rule does not.
    assert st.speedup is not None and st.speedup > 0, st.reason
    assert st.enabled == (st.speedup >= attention.MIN_SPEEDUP), st.reason
    if not st.enabled:
        assert "not faster here" in st.reason
        assert mx.fast.scaled_dot_product_attention is not attention._dispatch


def test_dispatch_takes_only_verify_sized_float32_calls_inside_the_block(fresh_attention):
    attention.status()
    sdpa = mx.fast.scaled_dot_product_attention
    q, k, v = _qkv(0, 1, 4, 2, 5, 30)
    before = attention.status().calls
    sdpa(q, k, v, scale=0.5, mask="causal")  # outside the block: MLX's function
    assert attention.status().calls == before
    with attention.verify_attention():
        out = sdpa(q, k, v, scale=0.5, mask="causal")
        assert attention.status().calls == before + 1
        # one query (a decode step), float16, sinks, a too-large score matrix: MLX's own
        q1 = q[:, :, :1]
        sdpa(q1, k, v, scale=0.5)
        sdpa(q.astype(mx.float16), k.astype(mx.float16), v.astype(mx.float16), scale=0.5)
        sdpa(q, k, v, scale=0.5, mask="causal", sinks=mx.zeros((4,)))
        # and one K/V head's scores past MAX_SCORES
        big_q, big_k, big_v = _qkv(1, 1, 1, 1, 64, attention.MAX_SCORES // 64 + 1)
        sdpa(big_q, big_k, big_v, scale=0.5, mask="causal")
        assert attention.status().calls == before + 1
        # past MAX_SCORES in all, but each K/V head fits: the replica, in slices
        wide = _qkv(2, 1, 8, 4, 64, attention.MAX_SCORES // (8 * 64) + 1)
        sliced = sdpa(*wide, scale=0.5, mask="causal")
        assert attention.status().calls == before + 2
    expected = attention._original(q, k, v, scale=0.5, mask="causal")
    assert np.array_equal(np.array(out), np.array(expected))
    expected = attention._original(*wide, scale=0.5, mask="causal")
    assert np.array_equal(np.array(sliced), np.array(expected))


def test_env_var_turns_it_off_and_changes_the_cost_key(fresh_attention, monkeypatch, models):
    on_key = model_fingerprint(models["llama"])
    attention._reset_for_tests()
    monkeypatch.setenv(attention.ENV, "off")
    st = attention.status()
    assert not st.enabled and attention.ENV in st.reason
    assert mx.fast.scaled_dot_product_attention is attention._original
    assert model_fingerprint(models["llama"]) != on_key  # curves are profiled per mode
    with attention.verify_attention():
        q, k, v = _qkv(2, 1, 4, 4, 3, 9)
        mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask="causal")
    assert attention.status().calls == 0


@pytest.mark.parametrize("arch", specdec.testing.ARCHITECTURES)
def test_model_logits_are_identical_inside_and_outside(models, arch):
    from mlx_lm.models.cache import make_prompt_cache

    m = models[arch]
    ids = mx.random.randint(0, m.args.vocab_size, (1, 29), key=mx.random.key(3))
    prompt, block = ids[:, :20], ids[:, 20:]
    outs = []
    for inside in (False, True):
        caches = make_prompt_cache(m)
        mx.eval(m(prompt, cache=caches))
        before = attention.status().calls
        if inside:
            with attention.verify_attention():
                logits = m(block, cache=caches)
        else:
            logits = m(block, cache=caches)
        outs.append((np.array(logits), attention.status().calls - before))
    (plain, n_plain), (replica, n_replica) = outs
    assert n_plain == 0
    assert n_replica > 0, f"{arch}: no attention call took the replica"
    assert np.array_equal(plain, replica)


def test_speculative_rounds_use_the_replica_and_match_mlx_lm(models, copy_prompts):
    from mlx_lm.generate import generate_step

    m = models["llama"]
    prompt = copy_prompts["llama"]
    with specdec.testing.plugin_host() as host:
        pipe = specdec.assemble(m, None, oracle_policy(m, "partial", block=6), host=host)
        before = attention.status().calls
        out = pipe.generate(prompt, max_tokens=24, temperature=0.0)
    assert out.stats.drafted > 0 and 0 < out.stats.accepted < out.stats.drafted
    assert attention.status().calls > before
    # mlx-lm's own greedy loop, outside specdec: MLX's attention throughout
    ref = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt), m, max_tokens=24, sampler=lambda x: mx.argmax(x, axis=-1)
        )
    ]
    assert out.tokens == ref
