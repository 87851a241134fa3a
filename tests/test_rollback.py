"""Caches after every round equal those of plain decoding; errors restore them."""

from __future__ import annotations

import mlx.core as mx
import pytest
import specdec
from core_support import oracle_policy
from mlx_lm.models import cache as C
from specdec.rollback import KVTrimRollback, RollbackPlan, RotatingWindowRollback
from specdec.testing import ARCHITECTURES, cache_view, check_caches_match_plain, plugin_host
from specdec.testing.checks import _compare_views


def assert_same_caches(expected: list, got: list, where: str) -> None:
    """Two lists of ``cache_view``s are equal: offsets, and every array bit for bit."""
    assert len(expected) == len(got), f"{where}: {len(got)} caches, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        _compare_views(e, g, 0.0, f"{where}, cache {i}")


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("corruption", ["none", "partial", 0.3])
def test_caches_match_plain_after_every_round(models, copy_prompts, arch, corruption):
    m = models[arch]
    worst = check_caches_match_plain(
        m, oracle_policy(m, corruption, block=5), copy_prompts[arch], max_tokens=30
    )
    assert worst <= 1e-4


class _LeakyRollback:
    """Deliberately wrong: never trims. The cache check must catch it."""

    name = "leaky"

    def supports(self, cache):
        return type(cache) is C.KVCache

    def begin(self, cache):
        class T:
            def commit(self, n_fed, n_keep):
                pass

            def abort(self):
                pass

        return T()


class _LeakyPlugin:
    @specdec.hookimpl
    def specdec_register_cache_rollbacks(self, register):
        register("leaky", _LeakyRollback)


def test_cache_check_detects_a_wrong_rollback(models, copy_prompts):
    m = models["llama"]
    with plugin_host(_LeakyPlugin()):
        with pytest.raises(AssertionError):
            check_caches_match_plain(
                m,
                oracle_policy(m, "partial", rollback="leaky"),
                copy_prompts["llama"],
                max_tokens=20,
            )


def _feed(model, cache, toks):
    return model(mx.array(toks)[None], cache=cache)


def test_rotating_rollback_exact_after_wrap_where_mlx_trim_is_not(models):
    """Feed a block past the window, reject part of it, continue: equal to feeding only the prefix."""
    m = models["gemma3"]
    prompt = list(range(1, 21))  # 20 tokens > window 8
    block = [30, 31, 32, 33, 34]
    keep = 2

    ref = C.make_prompt_cache(m)
    _feed(m, ref, prompt)
    for t in block[:keep]:
        _feed(m, ref, [t])
    ref_logits = _feed(m, ref, [40])[0, -1]

    ours = C.make_prompt_cache(m)
    _feed(m, ours, prompt)
    plan = RollbackPlan(ours, [KVTrimRollback(), RotatingWindowRollback()])
    assert plan.ok and plan.names() == ["rotating_window", "kv_trim"]
    txn = plan.begin()
    _feed(m, ours, block)
    txn.commit(len(block), keep)
    our_logits = _feed(m, ours, [40])[0, -1]
    assert mx.abs(our_logits - ref_logits).max().item() < 1e-4

    # mlx-lm's own trim leaves the rejected keys in the buffer once the window wrapped
    naive = C.make_prompt_cache(m)
    _feed(m, naive, prompt)
    _feed(m, naive, block)
    for c in naive:
        c.trim(len(block) - keep)
    naive_logits = _feed(m, naive, [40])[0, -1]
    assert mx.abs(naive_logits - ref_logits).max().item() > 1e-3


def test_abort_restores_every_cache_type(models):
    for arch in ARCHITECTURES:
        m = models[arch]
        cache = C.make_prompt_cache(m)
        _feed(m, cache, list(range(1, 15)))
        before = [cache_view(c) for c in cache]
        plan = RollbackPlan(cache, [KVTrimRollback(), RotatingWindowRollback()])
        txn = plan.begin()
        _feed(m, cache, [5, 6, 7])
        _feed(m, cache, [8])
        txn.abort()
        after = [cache_view(c) for c in cache]
        assert_same_caches(before, after, f"{arch} after abort")


class _Boom(Exception):
    pass


class _FailingVerifier:
    """Fails on the third forward, after the transaction began and the model ran."""

    name = "failing"

    def __init__(self):
        self.calls = 0

    def verify(self, model, tokens, caches):
        from specdec.verifiers import LogitsVerifier

        self.calls += 1
        out = LogitsVerifier().verify(model, tokens, caches)
        if self.calls == 3:
            raise _Boom("injected failure after the verify forward")
        return out


class _FailingPlugin:
    @specdec.hookimpl
    def specdec_register_verifiers(self, register):
        register("failing", _FailingVerifier)


def test_exception_mid_round_restores_caches_and_next_request_is_normal(models, copy_prompts):
    m = models["gemma3"]
    prompt = copy_prompts["gemma3"]
    with plugin_host(_FailingPlugin()):
        pol = oracle_policy(m, "partial", verifier="failing")
        pipe = specdec.assemble(m, policy=pol)
        seen = {}
        live = []

        def rec(result, caches):
            seen[result.start_position + len(result.committed)] = [cache_view(c) for c in caches]
            live[:] = [caches]  # the request's own cache list, to read after the failure

        stream = pipe.stream(prompt, max_tokens=20, on_round=rec)
        with pytest.raises(specdec.ComponentError, match="verifier 'failing'") as e:
            for _ in stream:
                pass
        assert isinstance(e.value.__cause__, _Boom)
        # the failed round's transaction was aborted: the caches are exactly those
        # recorded after the last round that completed
        assert seen and live, "no round completed before the injected failure"
        last = max(seen)
        assert_same_caches(
            seen[last], [cache_view(c) for c in live[0]], f"after the failure (at {last} tokens)"
        )
        # the pipeline serves the next request normally (the verifier counter is past 3 now)
        plain = specdec.assemble(m, policy="none").generate(prompt, max_tokens=20)
        again = pipe.generate(prompt, max_tokens=20)
        assert again.tokens == plain.tokens
        assert again.stats.drafted > 0


def test_failed_round_leaves_caches_as_before(models):
    """Drive a round by hand through the plan: an exception after the forward restores the caches."""
    m = models["llama"]
    cache = C.make_prompt_cache(m)
    _feed(m, cache, [1, 2, 3, 4])
    before = [cache_view(c) for c in cache]
    plan = RollbackPlan(cache, [KVTrimRollback()])
    txn = plan.begin()
    try:
        _feed(m, cache, [5, 6, 7])
        raise _Boom()
    except _Boom:
        txn.abort()
    after = [cache_view(c) for c in cache]
    assert [b[0] for b in before] == [a[0] for a in after] == [4, 4]
    assert_same_caches(before, after, "after the aborted round")


def test_unsupported_cache_falls_back_to_plain_with_reason(models, copy_prompts):
    m = models["llama"]

    class ArraysModel:
        """The tiny model with an extra ArraysCache layer nothing can roll back."""

        def __init__(self, inner):
            self.inner = inner
            self.args = inner.args

        def make_cache(self):
            return [*C.make_prompt_cache(self.inner), C.ArraysCache(1)]

        def __call__(self, x, cache):
            return self.inner(x, cache=cache[:-1])

    wrapped = ArraysModel(m)
    out = specdec.assemble(wrapped, policy=oracle_policy(m)).generate(
        copy_prompts["llama"], max_tokens=8
    )
    plain = specdec.assemble(m, policy="none").generate(copy_prompts["llama"], max_tokens=8)
    assert out.tokens == plain.tokens
    assert out.stats.drafted == 0
    assert "ArraysCache" in out.stats.speculation_off_reason
    assert "plugin" in out.stats.speculation_off_reason


def test_cache_list_delegates(models):
    m = models["llama"]
    inner = C.make_prompt_cache(m)
    cl = C.CacheList(*inner)
    from specdec.rollback import CacheListRollback

    plan = RollbackPlan([cl], [CacheListRollback(), KVTrimRollback()])
    assert plan.ok and plan.names() == ["cache_list"]
    for c in inner:
        c.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))
    txn = plan.begin()
    for c in inner:
        c.update_and_fetch(mx.ones((1, 2, 4, 16)), mx.ones((1, 2, 4, 16)))
    txn.commit(4, 1)
    assert [c.offset for c in inner] == [4, 4]


def test_bound_rollbacks_see_the_model_that_owns_the_caches(models, copy_prompts):
    """A rollback with ``bind(plan)`` reads ``plan.model`` before any ``supports`` call."""
    m = models["llama"]
    seen = []

    class _ModelAware:
        name = "model_aware"

        def bind(self, plan):
            seen.append((plan.model, len(plan.caches)))

        def supports(self, cache):
            return False

        def begin(self, cache):  # pragma: no cover - never chosen
            raise AssertionError

    class _Plugin:
        @specdec.hookimpl
        def specdec_register_cache_rollbacks(self, register):
            register("model_aware", _ModelAware)

    with plugin_host(_Plugin()):
        out = specdec.assemble(m, policy=oracle_policy(m)).generate(
            copy_prompts["llama"], max_tokens=4
        )
    assert seen and seen[0][0] is m and seen[0][1] == len(C.make_prompt_cache(m))
    assert "model_aware" not in out.stats.rollbacks
    assert RollbackPlan([], [KVTrimRollback()]).model is None
