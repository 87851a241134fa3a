"""Rounds queued ahead while drafting pauses: plain steps pipelined as in plain decoding;
a drafter that proposes after all gets its block fed on top of the queued step, in its
transaction; the output never changes."""

from __future__ import annotations

import pytest
import specdec
from specdec.testing import OracleDrafter, make_tiny_model, plugin_host
from specdec.testing.models import ARCHITECTURES


def _run(model, prompt, at, reference, corruption="none", verifier="logits", vopts=None, **kw):
    """Generate with the kit's oracle proposing ``reference`` only at history lengths ``at``."""
    policy = specdec.Policy(
        drafters=("oracle",),
        verifier=verifier,
        options={
            "oracle": {
                "reference": reference or [0],
                "at": at,
                "corruption": corruption,
                "vocab_size": 64,
            },
            **({verifier: vopts} if vopts else {}),
        },
    )
    with plugin_host(load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy=policy, host=host)
        return pipe.generate(prompt, **kw)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_paused_drafting_is_pipelined_and_exact(arch):
    model = make_tiny_model(arch, vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=40)
    ref = prompt + plain.tokens
    n = len(prompt)
    # Drafting pauses, resumes at n+12 and n+25 (the block is fed on the queued round).
    out = _run(model, prompt, {n, n + 12, n + 25}, ref, max_tokens=40)
    assert out.tokens == plain.tokens
    st = out.stats
    assert st.accepted > 0 and st.lookahead_rounds > 10
    assert st.lookahead_extended == 2 and st.lookahead_aborts == 0
    # A block of wrong drafts on the queued round: all rejected, the caches rolled back.
    out = _run(model, prompt, {n + 12, n + 25}, ref, corruption="full", max_tokens=40)
    assert out.tokens == plain.tokens
    assert out.stats.lookahead_extended == 2 and out.stats.drafted > 0
    assert out.stats.accepted == 0
    assert st.target_forwards == sum(st.block_sizes.values())
    # Never drafting: every round from the third on is queued ahead.
    out = _run(model, prompt, set(), ref, max_tokens=40)
    assert out.tokens == plain.tokens
    assert out.stats.lookahead_rounds >= 40 - 4 and out.stats.lookahead_aborts == 0
    for m in (1, 2, 3, 5):  # max_tokens stays exact
        assert _run(model, prompt, set(), ref, max_tokens=m).tokens == plain.tokens[:m]


def test_sampled_lookahead_draws_the_acceptors_token():
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for seed in range(3):
        plain = specdec.assemble(model, policy="none").generate(
            prompt, max_tokens=30, temperature=1.0, seed=seed
        )
        ref = prompt + plain.tokens
        out = _run(
            model, prompt, {len(prompt) + 10}, ref, max_tokens=30, temperature=1.0, seed=seed
        )
        assert out.tokens == plain.tokens
        # The lazily sampled token of a paused round is the acceptor's: nothing undone
        # (the round where the drafter proposed again feeds its block on the queued one).
        assert out.stats.lookahead_rounds > 10 and out.stats.lookahead_aborts <= 1
        assert out.stats.lookahead_extended == 1 and out.stats.drafted > 0


def test_a_stop_token_ends_the_stream_and_undoes_the_queued_round():
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=30).tokens
    stop = plain[15]
    first = plain.index(stop)
    ref = prompt + plain
    out = _run(model, prompt, set(), ref, max_tokens=30, stop_tokens=[stop])
    want = specdec.assemble(model, policy="none").generate(
        prompt, max_tokens=30, stop_tokens=[stop]
    )
    assert out.tokens == want.tokens == plain[:first]  # the stop token is not emitted
    assert out.stats.finish_reason == "stop" and out.stats.lookahead_rounds > 3


def test_no_lookahead_with_an_on_round_callback():
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seen = []
    out = _run(model, prompt, set(), [], max_tokens=12, on_round=lambda r, c: seen.append(r))
    assert len(seen) == out.stats.target_forwards == 12
    assert out.stats.lookahead_rounds == 0


def test_no_lookahead_for_drafters_that_read_the_caches():
    model = make_tiny_model("llama", vocab_size=64)

    class Kv(OracleDrafter):
        needs = frozenset({"kv"})

    drafter = Kv(reference=[0], at=())

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("sometimes", lambda **o: drafter)

    with plugin_host(P(), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["sometimes"]}, host=host)
        out = pipe.generate([3, 1, 4, 1, 5], max_tokens=12)
    assert out.stats.lookahead_rounds == 0 and out.stats.target_forwards == 12


def test_an_interrupt_during_plain_decoding_stays_an_interrupt(monkeypatch):
    model = make_tiny_model("llama", vocab_size=64)
    pipe = specdec.assemble(model, policy="none")
    real, calls = pipe.verifier.verify, []

    def verify(model, tokens, caches):
        calls.append(1)
        if len(calls) == 3:  # while a plain step is queued ahead of the one read back
            raise KeyboardInterrupt
        return real(model, tokens, caches)

    monkeypatch.setattr(pipe.verifier, "verify", verify)
    with pytest.raises(KeyboardInterrupt):
        pipe.generate([3, 1, 4, 1, 5], max_tokens=12)


def test_an_error_after_a_lookahead_was_queued_undoes_it():
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    seen = {"n": 0}

    class Boom(specdec.BaseDrafter):
        name = "boom"

        def session(self, ctx):
            class S(specdec.BaseDrafterSession):
                def propose(self, history, max_len):
                    return None

                def observe(self, result):
                    seen["n"] += 1
                    if seen["n"] == 6:
                        seen["offset"], seen["cache"] = ctx.caches[0].offset, ctx.caches[0]
                        raise RuntimeError("drafter bug")

            return S()

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("boom", Boom)

    with plugin_host(P(), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["boom"]}, host=host)
        with pytest.raises(RuntimeError, match="drafter bug"):
            for _ in pipe.stream(prompt, max_tokens=20):
                pass
    # When observe raised, a lookahead was in flight (its token fed): 6 rounds + 1;
    # the error undid it.
    assert seen["offset"] == len(prompt) - 1 + 6 + 1
    assert seen["cache"].offset == len(prompt) - 1 + 6


def test_row_projection_does_not_stop_a_block_fed_on_a_queued_round():
    """The hidden verifier's project="rows" marks its results; a block fed on a round
    queued ahead is still joined (the joined round uses the forward's logits)."""
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=40)
    n = len(prompt)
    out = _run(
        model,
        prompt,
        {n, n + 12, n + 25},
        prompt + plain.tokens,
        corruption="partial",
        verifier="hidden",
        vopts={"project": "rows"},
        max_tokens=40,
    )
    assert out.tokens == plain.tokens
    assert out.stats.lookahead_extended == 2 and out.stats.lookahead_aborts == 0
    # the first round is not queued ahead: it is judged row by row
    assert out.stats.row_projection["rounds"] >= 1
