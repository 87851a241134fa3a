"""Speculative decoding on tiny hybrid models through the core pipeline, with gdn_transaction."""

from __future__ import annotations

import pytest
import specdec
from gdn_support import NGRAM, copy_model, copy_prompt, draft_for
from mlx_lm.models import cache as C
from specdec.testing import (
    ToyTokenizer,
    cache_view,
    check_caches_match_plain,
    check_fewer_forwards,
    check_greedy_identity,
    check_sampled_distribution,
    plugin_host,
)
from specdec.testing.checks import _compare_views
from specdec_qwen_mtp_gdn import STRATEGIES, default_strategy


def with_strategy(policy, strategy):
    """``policy`` with gdn_transaction named first for every layer, using ``strategy``."""
    import attrs

    return attrs.evolve(
        policy,
        rollback="gdn_transaction",
        options={**policy.options, "gdn_transaction": {"strategy": strategy}},
    )


def draft_policy(arch):
    return specdec.Policy(
        name="draft",
        drafters=("draft_model",),
        options={"draft_model": {"model": draft_for(arch), "num_draft_tokens": 4}},
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_ngram_copy_is_token_identical(arch, strategy):
    """max_tokens 1..16 and a stop token inside an accepted block; drafting asserted."""
    totals = check_greedy_identity(
        copy_model(arch), with_strategy(NGRAM, strategy), copy_prompt(arch)
    )
    assert totals["drafted"] > 0 and totals["accepted"] > 0
    assert totals["target_forwards"] < totals["plain_forwards"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_draft_model_is_token_identical(arch, strategy):
    totals = check_greedy_identity(
        copy_model(arch), with_strategy(draft_policy(arch), strategy), copy_prompt(arch)
    )
    assert totals["drafted"] > 0 and totals["accepted"] > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_caches_equal_plain_decoding_after_every_round(arch, strategy):
    worst = check_caches_match_plain(
        copy_model(arch),
        with_strategy(NGRAM, strategy),
        copy_prompt(arch),
        max_tokens=32,
        atol=1e-5,
    )
    print(f"\n{arch}/{strategy}: caches vs plain decoding, max abs diff {worst:.3g}")


@pytest.mark.parametrize("policy", ["ngram", "draft"])
def test_fewer_target_forwards_than_plain(arch, policy):
    pol = NGRAM if policy == "ngram" else draft_policy(arch)
    plain, spec = check_fewer_forwards(copy_model(arch), pol, copy_prompt(arch), max_tokens=32)
    print(f"\n{arch}/{policy}: {spec} target forwards vs {plain} plain")


@pytest.mark.parametrize("policy", ["ngram", "draft"])
def test_sampled_distribution_is_the_targets(policy):
    """Point-mass (ngram_copy) and rejection with q (draft_model) acceptance keep the target's law."""
    arch = "qwen3_next"
    pol = NGRAM if policy == "ngram" else draft_policy(arch)
    p = check_sampled_distribution(
        copy_model(arch), pol, copy_prompt(arch), temperature=1.0, max_tokens=2, n_samples=800
    )
    assert p > 1e-3


class _Boom(Exception):
    pass


class _FailingVerifier:
    """Runs the verify forward, then fails on the third call (after the transaction began)."""

    name = "failing"

    def __init__(self):
        self.calls = 0
        self.before = None
        self.caches = None

    def verify(self, model, tokens, caches):
        from specdec.verifiers import LogitsVerifier

        self.calls += 1
        if self.calls == 3:
            self.caches = caches
            self.before = [cache_view(c) for c in caches]
        out = LogitsVerifier().verify(model, tokens, caches)
        if self.calls == 3:
            import mlx.core as mx

            mx.eval(out.logits)  # the forward really ran and moved the states
            raise _Boom("injected failure after the verify forward")
        return out


_VERIFIERS: list = []


class _FailingPlugin:
    @specdec.hookimpl
    def specdec_register_verifiers(self, register):
        def make():
            v = _FailingVerifier()
            _VERIFIERS.append(v)
            return v

        register("failing", make)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_failed_round_restores_the_caches_and_drops_speculative_state(arch, strategy):
    model, prompt = copy_model(arch), list(copy_prompt(arch))
    with plugin_host(_FailingPlugin()):
        pol = with_strategy(
            specdec.Policy(name="fail", drafters=("ngram_copy",), verifier="failing"), strategy
        )
        pipe = specdec.assemble(model, policy=pol)
        v = _VERIFIERS[-1]
        # the caller gets the failure named (verifier 'failing'), _Boom as its cause
        with pytest.raises(specdec.ComponentError, match="verifier 'failing'") as e:
            for _ in pipe.stream(prompt, max_tokens=20):
                pass
        assert isinstance(e.value.__cause__, _Boom)
        after = [cache_view(c) for c in v.caches]
        assert _compare_views(v.before, after, 0.0, "restored") == 0.0
        assert not any(hasattr(c, "_specdec_gdn_transaction") for c in v.caches)
        # the next request through the same pipeline is normal
        plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=20)
        again = pipe.generate(prompt, max_tokens=20)
        assert again.tokens == plain.tokens and again.stats.drafted > 0


def test_generated_pad_tokens_are_ordinary_inputs(arch):
    """Only prompt padding is masked: a generated token whose id is the PAD id is fed as is."""
    model, prompt = copy_model(arch), list(copy_prompt(arch))
    out = specdec.assemble(model, policy="none").generate(prompt, max_tokens=32).tokens
    pad = max(set(out), key=out.count)  # the most frequent generated token plays PAD
    tok = ToyTokenizer(vocab_size=64)
    tok.pad_token_id = pad
    totals = check_greedy_identity(model, NGRAM, prompt, tokenizer=tok, stop_tokens=[])
    assert totals["accepted"] > 0
    check_caches_match_plain(model, NGRAM, prompt, max_tokens=32, tokenizer=tok, atol=1e-5)
    caches = C.make_prompt_cache(model)
    assert all(getattr(c, "left_padding", None) is None for c in caches)


def test_plain_requests_are_untouched_by_the_plugin(arch):
    """The ``none`` policy runs mlx-lm's own path: no transaction is ever armed."""
    model, prompt = copy_model(arch), list(copy_prompt(arch))
    seen = []

    def rec(result, caches):
        seen.append(any(hasattr(c, "_specdec_gdn_transaction") for c in caches))

    out = specdec.assemble(model, policy="none").generate(prompt, max_tokens=8, on_round=rec)
    # the platform's default strategy (capture on CPU/CUDA, tape on Metal; test_plugin checks which)
    assert out.stats.rollbacks == [f"gdn_transaction:{default_strategy()}", "kv_trim"]
    assert seen and not any(seen)


def test_hybrid_draft_model_rolls_back_its_own_gdn_state(arch):
    """The draft_model drafter's own cache is hybrid too: the plugin's rollback serves it."""
    model = copy_model(arch)
    pol = specdec.Policy(
        name="hybrid-draft",
        drafters=("draft_model",),
        options={"draft_model": {"model": model, "num_draft_tokens": 4}},
    )
    totals = check_greedy_identity(model, pol, copy_prompt(arch), max_tokens_list=[1, 7, 16])
    # the target as its own draft: every draft token is accepted
    assert totals["drafted"] > 0 and totals["accepted"] == totals["drafted"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_block_fed_on_a_round_queued_ahead_rolls_back_exactly(arch, strategy):
    model = copy_model(arch)
    prompt = list(copy_prompt(arch))
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=40).tokens
    n = len(prompt)
    # The kit's oracle proposes only at two history lengths: drafting pauses, the core
    # queues rounds ahead and feeds each block on top of the queued forward (one
    # transaction over two forwards).
    from specdec_qwen_mtp_gdn import plugin as gdn_plugin

    for corruption, accepted in (("none", True), ("full", False)):
        pol = with_strategy(
            specdec.Policy(
                name="resumes",
                drafters=("oracle",),
                options={
                    "oracle": {
                        "reference": prompt + plain,
                        "at": [n + 12, n + 25],
                        "corruption": corruption,
                        "vocab_size": specdec.heads.model_vocab_size(model),
                    }
                },
            ),
            strategy,
        )
        with plugin_host(gdn_plugin, load_entry_points=False) as host:
            out = specdec.assemble(model, policy=pol, host=host).generate(prompt, max_tokens=40)
        assert out.tokens == plain
        st = out.stats
        assert st.lookahead_extended == 2 and st.drafted > 0
        assert (st.accepted > 0) is accepted  # every wrong draft rejected, rolled back


@pytest.mark.parametrize("strategy", ["capture", "tape"])
def test_rows_of_a_batch_roll_back_their_own_gdn_state(arch, strategy):
    from specdec.testing import check_batch_identity

    model = copy_model(arch)
    p = list(copy_prompt(arch))
    prompts = [p, p[3:], p[:12] + p[:12], p[5:]]
    pol = specdec.Policy(
        name="ngram-batch",
        drafters=("ngram_copy",),
        rollback="gdn_transaction",
        options={"gdn_transaction": {"strategy": strategy}},
    )
    out = check_batch_identity(model, pol, prompts, max_tokens=[24, 16, 20, 24])
    assert out["max_batch_rows"] == 4 and out["accepted"] > 0


def test_rerun_rows_of_a_batch_decode_plainly_with_the_reason(arch):
    model = copy_model(arch)
    p = list(copy_prompt(arch))
    pol = specdec.Policy(
        name="ngram-rerun",
        drafters=("ngram_copy",),
        rollback="gdn_transaction",
        options={"gdn_transaction": {"strategy": "rerun"}},
    )
    res = specdec.assemble(model, policy=pol).generate_batch([p, p[2:]], max_tokens=8)
    want = specdec.assemble(model, policy="none").generate(p, max_tokens=8).tokens
    assert res[0].tokens == want and res[0].stats.drafted == 0
    assert "gdn_transaction:rerun" in res[0].stats.speculation_off_reason
