"""Sampled output has exactly the target's distribution; seeded runs are position-keyed."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import oracle_policy
from specdec.acceptors import GreedyAcceptor, PointMassAcceptor, RejectionAcceptor
from specdec.sampling import Sampler, position_key
from specdec.testing import (
    check_sampled_distribution,
    check_sampled_identity,
    chi_square_p_value,
    make_tiny_model,
)

V = 6


def _target_logits():
    rng = np.random.default_rng(0)
    return mx.array(rng.normal(size=(3, V)).astype(np.float32) * 1.5)


def _exact_first_two(logits, sampler):
    p = np.array(sampler.probs(logits))
    # with block [d0, d1] fixed, rows are independent of the path in this synthetic setting
    return p


@pytest.mark.parametrize("acceptor", [PointMassAcceptor(), RejectionAcceptor()])
def test_acceptor_first_token_distribution_chi_square(acceptor):
    """The first emitted token follows p whatever the (deterministic) draft."""
    logits = _target_logits()
    sampler_probs = np.array(Sampler(temperature=1.0, seed=0).probs(logits))
    block = [int(np.argmax(sampler_probs[0])), 2]
    counts = Counter()
    n = 3000
    for seed in range(n):
        s = Sampler(temperature=1.0, seed=seed)
        acc = acceptor.accept(block, None, logits, s, [100, 101, 102])
        first = block[0] if acc.n_accepted >= 1 else acc.token
        counts[(first,)] += 1
    expected = {(t,): float(sampler_probs[0][t]) for t in range(V)}
    p = chi_square_p_value(counts, expected, n)
    assert p > 1e-3, p


def test_rejection_with_draft_probs_chi_square():
    """Leviathan acceptance with a real q: draft d ~ q, emitted first token ~ p."""
    logits = _target_logits()
    p = np.array(Sampler(temperature=1.0, seed=0).probs(logits))
    q = np.full((2, V), 1.0 / V, dtype=np.float32)
    q[0] = np.array([0.5, 0.1, 0.1, 0.1, 0.1, 0.1], dtype=np.float32)
    rng = np.random.default_rng(1)
    counts = Counter()
    n = 3000
    acc = RejectionAcceptor()
    for seed in range(n):
        block = [int(rng.choice(V, p=q[0])), int(rng.choice(V, p=q[1]))]
        s = Sampler(temperature=1.0, seed=seed)
        a = acc.accept(block, mx.array(q), logits, s, [7, 8, 9])
        counts[(block[0] if a.n_accepted >= 1 else a.token,)] += 1
    pv = chi_square_p_value(counts, {(t,): float(p[0][t]) for t in range(V)}, n)
    assert pv > 1e-3, pv


def test_greedy_acceptor_prefix():
    logits = _target_logits()
    am = mx.argmax(logits, axis=-1).tolist()
    a = GreedyAcceptor().accept([am[0], (am[1] + 1) % V], None, logits, Sampler(), [0, 1, 2])
    assert a.n_accepted == 1 and a.token == am[1]
    a = GreedyAcceptor().accept([am[0], am[1]], None, logits, Sampler(), [0, 1, 2])
    assert a.n_accepted == 2 and a.token == am[2]


def test_position_keys_depend_only_on_seed_and_position():
    a = mx.random.uniform(key=position_key(5, 10)).item()
    b = mx.random.uniform(key=position_key(5, 10)).item()
    c = mx.random.uniform(key=position_key(5, 11)).item()
    d = mx.random.uniform(key=position_key(6, 10)).item()
    assert a == b and a != c and a != d


def test_sampler_matches_mlx_lm_filters():
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logits = _target_logits()
    s = Sampler(temperature=0.7, top_p=0.8, top_k=3, min_p=0.05, seed=0)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ref = apply_top_k(apply_min_p(apply_top_p(lp, 0.8), 0.05), 3) / 0.7
    assert np.allclose(np.array(s.scaled_logits(logits)), np.array(ref))
    probs = np.array(s.probs(logits))
    assert np.allclose(probs.sum(-1), 1.0, atol=1e-5)
    assert ((probs > 0).sum(-1) <= 3).all()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_point_mass_distribution_end_to_end(models, arch):
    m = models[arch]
    prompt = [3, 17, 42, 9, 28]
    p = check_sampled_distribution(
        m, oracle_policy(m, "none", block=2), prompt, temperature=1.0, max_tokens=2, n_samples=600
    )
    assert p > 1e-3


def test_rejection_distribution_end_to_end_with_draft_model(models):
    m = models["llama"]
    draft = make_tiny_model("llama", seed=2)
    pol = specdec.Policy(
        name="draft",
        drafters=("draft_model",),
        options={"draft_model": {"model": draft, "num_draft_tokens": 2}},
    )
    p = check_sampled_distribution(
        m, pol, [3, 17, 42, 9, 28], temperature=1.0, max_tokens=2, n_samples=600
    )
    pipe = specdec.assemble(m, policy=pol)
    out = pipe.generate([3, 17, 42, 9, 28], max_tokens=8, temperature=1.0, seed=1)
    assert out.stats.acceptors.get("rejection", 0) > 0
    assert p > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_seeded_sampled_run_with_deterministic_drafts_equals_plain_seeded_run(
    models, copy_prompts, arch
):
    m = models[arch]
    r = check_sampled_identity(
        m, oracle_policy(m, "partial"), copy_prompts[arch], seeds=range(4), temperature=0.8
    )
    assert r["drafted"] > 0 and r["accepted"] > 0


def test_sampled_identity_with_top_p_top_k_min_p(models, copy_prompts):
    m = models["llama"]
    r = check_sampled_identity(
        m,
        oracle_policy(m, "none"),
        copy_prompts["llama"],
        seeds=range(3),
        temperature=1.0,
        top_p=0.9,
        top_k=5,
        min_p=0.02,
    )
    assert r["accepted"] > 0


def test_same_seed_same_output_different_seed_differs(models, copy_prompts):
    pipe = specdec.assemble(models["gemma3"], policy="none")
    a = pipe.generate(copy_prompts["gemma3"], max_tokens=16, temperature=1.5, seed=3).tokens
    b = pipe.generate(copy_prompts["gemma3"], max_tokens=16, temperature=1.5, seed=3).tokens
    c = pipe.generate(copy_prompts["gemma3"], max_tokens=16, temperature=1.5, seed=4).tokens
    assert a == b and a != c


class _AlwaysAccept:
    """Deliberately wrong acceptor: keeps every draft. The chi-square check must catch it."""

    name = "always"

    def accept(self, block, draft_probs, logits, sampler, positions):
        from specdec.roles import Acceptance

        k = len(block)
        return Acceptance(n_accepted=k, token=sampler.sample(logits[k : k + 1], [positions[k]])[0])


class _AlwaysAcceptPlugin:
    @specdec.hookimpl
    def specdec_register_acceptors(self, register):
        register("always", _AlwaysAccept)


def test_distribution_check_catches_a_wrong_acceptor(models):
    from specdec.testing import plugin_host

    m = models["llama"]
    with plugin_host(_AlwaysAcceptPlugin()):
        pol = oracle_policy(m, "full", block=1, acceptor="always")
        with pytest.raises(AssertionError, match="chi-square"):
            check_sampled_distribution(
                m, pol, [3, 17, 42, 9, 28], temperature=1.0, max_tokens=2, n_samples=300
            )
