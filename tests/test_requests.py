"""Requests: bad input, stop handling, exact max_tokens, streaming text, processors, mlx-lm parity."""

from __future__ import annotations

import mlx.core as mx
import pytest
import specdec
from core_support import oracle_policy
from specdec.testing import ToyTokenizer, check_greedy_identity


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
        ({"temperature": -0.1}, "temperature must be a number >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"min_p": 2.0}, "min_p must be in [0, 1]"),
        ({"stop": "x"}, "stop must be a list of non-empty strings"),
    ],
)
def test_bad_request_arguments_fail_before_model_work(models, kwargs, needle):
    calls = []

    class Spy:
        def __init__(self, m):
            self.m, self.args = m, m.args

        def __call__(self, *a, **k):
            calls.append(1)
            return self.m(*a, **k)

        def make_cache(self):
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(self.m)

    pipe = specdec.assemble(Spy(models["llama"]), policy="none")
    with pytest.raises(specdec.RequestError) as e:
        pipe.generate([1, 2, 3], **kwargs)
    assert needle in str(e.value)
    assert calls == []


def test_bad_prompts(models):
    pipe = specdec.assemble(models["llama"], policy="none")
    with pytest.raises(specdec.RequestError, match="prompt is empty"):
        pipe.generate([])
    with pytest.raises(specdec.RequestError, match=r"token ids must be in \[0, 64\)"):
        pipe.generate([1, 99])
    with pytest.raises(specdec.RequestError, match="no tokenizer"):
        pipe.generate("hello")


def test_unknown_component_fails_at_assemble_with_installed_list(models):
    with pytest.raises(specdec.UnknownComponentError) as e:
        specdec.assemble(models["llama"], policy={"drafters": ["nope"]})
    assert "installed drafters are" in str(e.value) and "draft_model" in str(e.value)


def test_missing_model_path_is_a_clear_error():
    with pytest.raises(specdec.ModelLoadError, match="does not exist"):
        specdec.assemble("./no/such/model", policy="none")


def test_draft_model_with_another_vocabulary_is_refused(models):
    from specdec.testing import make_tiny_model

    other = make_tiny_model("llama", vocab_size=80)
    with pytest.raises(
        specdec.ModelLoadError, match="vocabulary size 80 differs from the target's 64"
    ):
        specdec.assemble(models["llama"], policy="none", draft_model=other)


@pytest.mark.parametrize("mt", [1, 2, 3, 7, 16])
def test_max_tokens_exact_with_long_blocks(models, copy_prompts, mt):
    m = models["qwen3"]
    out = specdec.assemble(m, policy=oracle_policy(m, block=16)).generate(
        copy_prompts["qwen3"], max_tokens=mt
    )
    assert len(out.tokens) == mt and out.finish_reason == "length"
    assert out.stats.generation_tokens == mt


def test_eos_inside_accepted_block_ends_stream_without_emitting_it(models, copy_prompts):
    m = models["gemma3"]
    plain_tokens = (
        specdec.assemble(m, policy="none").generate(copy_prompts["gemma3"], max_tokens=20).tokens
    )
    eos = plain_tokens[5]
    cut = plain_tokens.index(eos)
    tok = ToyTokenizer(64, eos_token_ids=[eos])
    pipe = specdec.assemble(m, tok, policy=oracle_policy(m, block=8))
    out = pipe.generate(copy_prompts["gemma3"], max_tokens=20)
    assert out.tokens[:cut] == plain_tokens[:cut]
    assert out.finish_reason == "stop"
    assert out.stats.generation_tokens == cut
    assert out.stats.accepted > 0  # the stop was inside an accepted block


def test_stop_strings_cut_the_text(models, copy_prompts):
    m = models["llama"]
    tok = ToyTokenizer(64)
    plain = specdec.assemble(m, tok, policy="none").generate(copy_prompts["llama"], max_tokens=20)
    stop = plain.text[6:8]
    first = plain.text.find(stop)
    out = specdec.assemble(m, tok, policy=oracle_policy(m, block=8)).generate(
        copy_prompts["llama"], max_tokens=20, stop=[stop]
    )
    assert out.text == plain.text[:first]
    assert out.finish_reason == "stop"


def test_the_last_response_names_the_stop_string_that_matched(models, copy_prompts):
    m = models["llama"]
    tok = ToyTokenizer(64)
    pipe = specdec.assemble(m, tok, policy=oracle_policy(m, block=8))
    plain = list(pipe.stream(copy_prompts["llama"], max_tokens=20))
    assert plain[-1].finish_reason == "length" and plain[-1].stop_string is None
    text = "".join(r.text for r in plain)
    stop = text[6:8]
    # of the stop strings found, the one found first in the text; found by the last
    # token max_tokens allows, it still ends the stream as a stop
    for mt in (20, text.find(stop) + len(stop)):
        rs = list(pipe.stream(copy_prompts["llama"], max_tokens=mt, stop=["\x7fnever", stop]))
        assert rs[-1].finish_reason == "stop" and rs[-1].stop_string == stop, mt
        assert "".join(r.text for r in rs) == text[: text.find(stop)]
        assert all(r.stop_string is None for r in rs[:-1])


def test_streaming_yields_each_token_with_incremental_text(models, copy_prompts):
    m = models["llama"]
    tok = ToyTokenizer(64)
    pipe = specdec.assemble(m, tok, policy=oracle_policy(m, block=6))
    rs = list(pipe.stream(copy_prompts["llama"], max_tokens=12))
    assert len(rs) == 12
    assert "".join(r.text for r in rs) == tok.decode([r.token for r in rs])
    assert any(r.from_draft for r in rs) and not all(r.from_draft for r in rs)
    assert rs[-1].finish_reason == "length" and rs[-1].stats.generation_tokens == 12
    assert [r.position for r in rs] == list(
        range(len(copy_prompts["llama"]), len(copy_prompts["llama"]) + 12)
    )


def test_string_prompt_through_tokenizer(models):
    tok = ToyTokenizer(64)
    pipe = specdec.assemble(models["llama"], tok, policy="none")
    a = pipe.generate("hello world", max_tokens=5)
    b = pipe.generate(tok.encode("hello world"), max_tokens=5)
    assert a.tokens == b.tokens and a.text == tok.decode(a.tokens)


@pytest.mark.parametrize(
    "procs",
    [
        {"repetition_penalty": 1.5},
        {"presence_penalty": 8.0},
        {"frequency_penalty": 4.0},
        {"logit_bias": {5: 30.0}},
    ],
)
def test_logits_processors_keep_greedy_identity_and_take_effect(models, copy_prompts, procs):
    m = models["llama"]
    prompt = copy_prompts["llama"]
    plain = specdec.assemble(m, policy="none")
    with_procs = plain.generate(prompt, max_tokens=24, **procs).tokens
    assert with_procs[:16] != plain.generate(prompt, max_tokens=16).tokens
    # drafts that follow the processed continuation (half of each block corrupted)
    pol = specdec.Policy(
        drafters=("oracle",),
        options={
            "oracle": {"reference": prompt + with_procs, "corruption": "partial", "vocab_size": 64}
        },
    )
    report = check_greedy_identity(m, pol, prompt, max_tokens_list=[1, 5, 16], **procs)
    assert 0 < report["accepted"] < report["drafted"]


def test_user_logits_processor_sees_each_positions_history(models, copy_prompts):
    m = models["llama"]
    prompt = copy_prompts["llama"]
    seen = []

    def ban_last(tokens, logits):
        seen.append(int(tokens.shape[0]))
        return logits.at[:, tokens[-1]].add(-100.0)

    a = specdec.assemble(m, policy="none").generate(
        prompt, max_tokens=10, logits_processors=[ban_last]
    )
    n_plain = list(seen)
    seen.clear()
    b = specdec.assemble(m, policy=oracle_policy(m, "partial")).generate(
        prompt, max_tokens=10, logits_processors=[ban_last]
    )
    assert a.tokens == b.tokens
    assert all(x != y for x, y in zip(a.tokens, a.tokens[1:]))
    assert n_plain == list(range(len(prompt), len(prompt) + 10))
    assert set(n_plain) <= set(seen)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_none_policy_matches_mlx_lm_generate_step(models, arch):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_logits_processors

    m = models[arch]
    prompt = [3, 17, 42, 9, 28, 5, 61, 11] * 3
    for procs in ({}, {"repetition_penalty": 1.3}):
        ref = []
        lp = make_logits_processors(**procs) if procs else None
        for tok, _ in generate_step(mx.array(prompt), m, max_tokens=24, logits_processors=lp):
            ref.append(int(tok))
        ours = specdec.assemble(m, policy="none").generate(prompt, max_tokens=24, **procs).tokens
        assert ours == ref


def test_stats_fields(models, copy_prompts):
    m = models["llama"]
    out = specdec.assemble(m, policy=oracle_policy(m, "partial")).generate(
        copy_prompts["llama"], max_tokens=20
    )
    d = out.stats.to_dict()
    for k in (
        "target_forwards",
        "drafted",
        "accepted",
        "tokens_per_forward",
        "acceptance_rate",
        "prompt_tps",
        "decode_tps",
        "peak_memory_gb",
        "per_drafter",
        "speculation_off_reason",
    ):
        assert k in d
    assert d["per_drafter"]["oracle"]["drafted"] == d["drafted"] > 0
    assert d["tokens_per_forward"] > 1
    assert 0 < d["acceptance_rate"] < 1
    assert d["speculation_off_reason"] is None
    assert (
        specdec.assemble(m, policy="none")
        .generate([1, 2], max_tokens=2)
        .stats.speculation_off_reason
    )


def test_stats_time_verify_and_commit_in_speculative_rounds(models, copy_prompts):
    m = models["gemma3"]
    out = specdec.assemble(m, policy=oracle_policy(m, "partial")).generate(
        copy_prompts["gemma3"], max_tokens=16
    )
    st = out.stats
    assert st.verify_time_s > 0 and st.commit_time_s > 0
    assert st.rollback_fraction == st.commit_time_s / st.verify_time_s
    assert "rollback_fraction" in st.to_dict()
    plain = specdec.assemble(m, policy="none").generate(copy_prompts["gemma3"], max_tokens=4).stats
    assert plain.verify_time_s == plain.commit_time_s == plain.rollback_fraction == 0

    # rounds of the speculative loop that drafted nothing are not counted
    undrafted = specdec.assemble(
        m, policy=oracle_policy(m, "none", block=16, min_block=16)
    ).generate(copy_prompts["gemma3"], max_tokens=10)
    st = undrafted.stats
    assert st.drafted == 0 and st.target_forwards == 10 and st.speculation_off_reason is None
    assert st.verify_time_s == st.commit_time_s == st.rollback_fraction == 0


def test_check_request_refuses_what_stream_would_before_any_model_work(models):
    pipe = specdec.assemble(models["llama"], policy={"drafters": [], "acceptor": "greedy"})
    pipe.check_request(max_tokens=4, temperature=0.0, seed=3)  # fine; extra keys ignored
    with pytest.raises(specdec.RequestError, match="acceptor 'greedy'"):
        pipe.check_request(temperature=0.7)
    with pytest.raises(specdec.RequestError, match="top_p"):
        pipe.check_request(top_p=0.0)
    with pytest.raises(specdec.RequestError, match="stop"):
        pipe.check_request(stop=[""])


def test_encode_messages_needs_a_chat_template(models):
    pipe = specdec.assemble(models["llama"], ToyTokenizer(64), policy="none")
    with pytest.raises(specdec.RequestError, match="no chat template"):
        pipe.encode_messages([{"role": "user", "content": "hi"}])
    # encode_prompt falls back to plain encoding without a template
    assert pipe.encode_prompt("hi") == pipe.encode_prompt("hi", chat_template=False)
