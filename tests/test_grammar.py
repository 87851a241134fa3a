"""Grammar-constrained decoding (``Request.grammar``, :mod:`specdec.grammar`): output the
grammar allows, greedy output identical to constrained plain decoding, the constrained
distribution kept under sampling (with draft probabilities too), forced tokens drafted
and accepted, bad grammars refused before any model work."""

from __future__ import annotations

import json
import re

import pytest
import specdec
from core_support import OneAmountPlugin, oracle_policy, write_json_tokenizer
from specdec.errors import RequestError
from specdec.grammar import Grammar
from specdec.testing import (
    check_batch_identity,
    check_greedy_identity,
    check_sampled_distribution,
    check_sampled_identity,
    make_tiny_model,
    plugin_host,
)

VOCAB = 320

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "city": {"enum": ["Portland", "Paris"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
REGEX = "(yes|no|maybe) [0-9]{2,4}"
LARK = 'start: "[" item ("," item)* "]"\nitem: "true" | "false" | "null"'

GRAMMARS = {
    "json_schema": {"json_schema": SCHEMA},
    "regex": {"regex": REGEX},
    "lark": {"lark": LARK},
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return write_json_tokenizer(tmp_path_factory.mktemp("json-tokenizer"), VOCAB)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode('Alice Johnson lives in Portland. {"name":"Alice","city":"Portland"} yes 42')


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        out = json.loads(text)
        return (
            set(out) == {"name", "city", "age"}
            and out["city"] in ("Portland", "Paris")
            and 0 <= out["age"] <= 99
            and len(out["name"]) <= 8
        )
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return re.fullmatch(r"\[(true|false|null)(,(true|false|null))*\]", text) is not None


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_constrained_output_is_valid(model, tok, prompt, kind):
    """Plain and speculative constrained output both finish a valid document."""
    for policy in ("none", "forced"):
        pipe = specdec.assemble(model, tok, policy)
        r = pipe.generate(prompt, max_tokens=120, grammar=GRAMMARS[kind])
        assert r.finish_reason == "stop", (policy, r.text)
        assert valid(kind, r.text), (policy, r.text)
        assert r.stats.grammar["kind"] == kind
    assert r.stats.grammar["forced"] > 0  # the forced policy drafted forced tokens
    assert r.stats.per_drafter["grammar"]["accepted"] == r.stats.grammar["forced"]


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("policy", ["forced", "oracle"])
def test_greedy_identity_under_grammar(model, tok, prompt, kind, policy):
    pol = (
        oracle_policy(model, corruption=0.3, block=4, forced_drafts=True)
        if policy == "oracle"
        else policy
    )
    tot = check_greedy_identity(
        model,
        pol,
        prompt,
        tokenizer=tok,
        max_tokens_list=[1, 2, 3, 5, 8, 13, 40],
        grammar=GRAMMARS[kind],
    )
    assert tot["target_forwards"] < tot["plain_forwards"]


def test_drafts_the_grammar_forbids_are_cut(model, tok, prompt):
    """The oracle drafts the unconstrained continuation: the grammar cuts the tokens it
    forbids before verify, and what is left is accepted."""
    grammar = {"regex": "[^;]{10,80};"}
    pipe = specdec.assemble(model, tok, oracle_policy(model, block=6, forced_drafts=False))
    r = pipe.generate(prompt, max_tokens=60, grammar=grammar)
    g = r.stats.grammar
    assert g["cut"] > 0 and r.stats.per_drafter["oracle"]["accepted"] > 0, r.stats
    assert g["forced"] == 0  # forced_drafts off
    plain = specdec.assemble(model, tok, "none").generate(prompt, max_tokens=60, grammar=grammar)
    assert plain.tokens == r.tokens


@pytest.mark.parametrize("kind", ["json_schema", "lark"])
def test_seeded_sampling_identity_under_grammar(model, tok, prompt, kind):
    check_sampled_identity(
        model,
        oracle_policy(model, corruption=0.3, block=4, forced_drafts=True),
        prompt,
        tokenizer=tok,
        seeds=range(4),
        max_tokens=30,
        temperature=1.0,
        grammar=GRAMMARS[kind],
    )


def _draft_model_policy():
    # the target's weights with a flatter head: q near p, so drafts are accepted
    draft = make_tiny_model("llama", vocab_size=VOCAB, seed=1, sharpness=4.0)
    return specdec.Policy(
        name="dm",
        drafters=("draft_model",),
        options={"draft_model": {"model": draft, "num_draft_tokens": 2}},
    )


@pytest.mark.parametrize(
    ("grammar", "max_tokens"),
    [
        ({"regex": "[a-z ]{3,12};"}, 2),  # no end within the first two tokens
        # where the grammar may end, q has mass on EOS, which ends the block; outputs
        # that end early count as the tokens before the end
        ({"regex": "(a|b|c|ab|ca|bc){1,3}"}, 3),
    ],
    ids=["no-end", "may-end"],
)
def test_sampled_distribution_with_draft_probabilities(model, tok, prompt, grammar, max_tokens):
    """A draft model's ``q`` is conditioned on the grammar's mask (stop tokens left out):
    the joint of the first tokens is the target's under the grammar (chi-square)."""
    check_sampled_distribution(
        model,
        _draft_model_policy(),
        prompt,
        tokenizer=tok,
        max_tokens=max_tokens,
        n_samples=1200,
        grammar=grammar,
    )


def test_renormalise_conditions_q_on_the_mask(model, tok, prompt):
    """Draft probabilities become ``q * mask / sum(q * mask)`` row by row, each row with
    the mask after the block's tokens before it (a draft the mask forbids ends the block,
    so the drafts verified were drawn inside it)."""
    import mlx.core as mx
    import numpy as np

    pipe = specdec.assemble(model, tok, "none")
    g = pipe.grammar_state(specdec.Request(grammar={"regex": "(ab|cd)x+"}))
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    assert g.advance([a, b]) == 2  # rows 0, 1, 2 filled
    q = mx.softmax(mx.random.normal((2, VOCAB)), axis=-1)
    out = np.array(g.renormalise(q))
    for i in range(2):
        allowed = np.array([g.allows(i, t) for t in range(VOCAB)])
        want = np.where(allowed, np.array(q[i]), 0.0)
        np.testing.assert_allclose(out[i], want / want.sum(), rtol=1e-5, atol=1e-7)
    assert not allowed.all() and allowed.sum() >= 1
    g.undo()
    assert g.advance([b]) == 0  # "b" cannot start the output: the walk stops there


def test_forced_only_policy_counts(model, tok, prompt):
    pipe = specdec.assemble(model, tok, "forced")
    r = pipe.generate(prompt, max_tokens=60, grammar=GRAMMARS["lark"])
    s = r.stats
    assert s.target_forwards < s.generation_tokens
    assert s.drafted == s.accepted == s.grammar["forced"] > 0
    assert s.grammar["mask_time_s"] > 0
    # without a grammar the forced preset decodes plainly
    r = pipe.generate(prompt, max_tokens=8)
    assert r.stats.drafted == 0 and r.stats.grammar == {}


def test_policy_forced_drafts():
    assert specdec.Policy(drafters=("x",)).forces
    assert not specdec.Policy().forces
    assert specdec.Policy(forced_drafts=True).forces
    assert not specdec.Policy(drafters=("x",), forced_drafts=False).forces
    with pytest.raises(specdec.PolicyError, match="forced_drafts must be true, false"):
        specdec.Policy(forced_drafts="yes")


@pytest.mark.parametrize(
    ("grammar", "match"),
    [
        ({"json": {}}, "grammar must be one of"),
        ({"json_schema": {"type": "foo"}}, "Invalid type: foo"),
        ({"json_schema": "{not json"}, "json_schema is not valid"),
        ({"json_schema": [1]}, "must be a JSON object"),
        ({"regex": "("}, "unclosed group"),
        ({"regex": ""}, "non-empty string"),
        ({"lark": "start: foo"}, 'unknown name: "foo"'),
        ("start: x", "grammar must be one of"),
    ],
)
def test_bad_grammar_is_a_request_error(grammar, match):
    with pytest.raises(RequestError, match=match):
        specdec.Request(grammar=grammar)


def test_bad_grammar_refused_before_model_work(model, tok, prompt):
    pipe = specdec.assemble(model, tok, "forced")
    rollback_less = {"lark": "start: txt\ntxt[max_tokens=3]: /[a-z]+/"}
    with pytest.raises(RequestError, match="cannot be rolled back"):
        pipe.check_request(grammar=rollback_less)
    with pytest.raises(RequestError, match="cannot be rolled back"):
        next(iter(pipe.stream(prompt, grammar=rollback_less)))
    with pytest.raises(RequestError, match="Invalid type"):
        pipe.check_request(grammar={"json_schema": {"type": "foo"}})
    with pytest.raises(RequestError, match="has none"):
        specdec.assemble(model, None, "none").check_request(grammar={"regex": "a+"})
    from specdec.testing.toy_tokenizer import ToyTokenizer

    toy = specdec.assemble(make_tiny_model("llama"), ToyTokenizer(), "none")
    with pytest.raises(RequestError, match="reads Hugging Face fast tokenizers"):
        toy.check_request(grammar={"regex": "a+"})
    with pytest.raises(RequestError, match="cannot be rolled back"):
        specdec.assemble(model, tok, "none").batch().add(prompt, grammar=rollback_less)
    # the pipeline serves the next request
    assert pipe.generate(prompt, max_tokens=20, grammar={"regex": "a+"}).text.startswith("a")


def test_grammar_record_is_frozen_and_reused():
    g = Grammar.of({"json_schema": json.dumps(SCHEMA)})
    assert Grammar.of(g) is g and g.kind == "json_schema"
    assert specdec.Request(grammar=g).grammar is g
    assert json.loads(g.source) == SCHEMA


@pytest.mark.parametrize("policy", ["forced", "oracle"])
def test_batch_rows_under_grammars(model, tok, prompt, policy):
    """Rows of a batch, each with its own grammar (or none), joining while others run:
    each equal to its request decoded alone with constrained plain decoding."""
    pol = oracle_policy(model, corruption=0.3, block=4, forced_drafts=True)
    pol = pol if policy == "oracle" else specdec.load_policy("forced")
    check_batch_identity(
        model,
        pol,
        [prompt, prompt[:-3], prompt[5:]],
        max_tokens=[40, 13, 30],
        max_rows=2,
        tokenizer=tok,
        grammar=GRAMMARS["json_schema"],
    )
    spec = specdec.assemble(model, tok, pol)
    plain = specdec.assemble(model, tok, "none")
    grammars = [GRAMMARS["lark"], None, GRAMMARS["regex"], GRAMMARS["json_schema"]]
    batch = spec.batch(3)
    rows = {}
    for i, g in enumerate(grammars):
        extra = {} if g is None else {"grammar": g}
        rows[batch.add(prompt[i:], max_tokens=30, **extra)] = (i, extra)
    got: dict[int, list[int]] = {i: [] for i in range(len(grammars))}
    forced = 0
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            i, _ = rows[ev.row]
            if not ev.response.is_stop_token:
                got[i].append(ev.response.token)
            if ev.response.stats is not None:
                forced += ev.response.stats.grammar.get("forced", 0)
                assert max(ev.response.stats.batch_rows) > 1
    for i, extra in rows.values():
        alone = plain.generate(prompt[i:], max_tokens=30, **extra)
        assert got[i] == alone.tokens, (i, extra)
        if extra and alone.finish_reason == "stop":
            assert valid(next(iter(extra["grammar"])), alone.text), alone.text
    assert forced > 0


def test_renormalise_leaves_stop_tokens_out(model, tok):
    """Where the grammar may end, a drafted stop token ends the block as a forbidden one
    does: ``q`` conditioned on the mask has no mass on the stop tokens."""
    import mlx.core as mx
    import numpy as np

    g = specdec.assemble(model, tok, "none").grammar_state(specdec.Request(grammar={"regex": "a+"}))
    a = tok.encode("a")[0]
    g.advance(())
    g.commit(0, a)  # "a": now "a" or the end
    g.advance(())
    (eos,) = g.eos
    assert g.allows(0, eos) and g.allows(0, a)
    q = np.zeros((1, VOCAB), np.float32)
    q[0, eos], q[0, a] = 0.5, 0.5
    out = np.array(g.renormalise(mx.array(q)))
    assert out[0, eos] == 0.0 and out[0, a] == pytest.approx(1.0)


def test_exact_joint_masks_each_position_after_its_prefix(model, tok, prompt):
    """The kit's reference under a grammar: every sequence it gives weight to is one the
    grammar allows token by token (the second token's mask is the one after the first)."""
    from specdec.sampling import Sampler
    from specdec.testing.checks import _exact_joint

    grammar = {"regex": "(ab|cd)x+"}
    joint = _exact_joint(model, prompt, Sampler(temperature=1.0), 2, tokenizer=tok, grammar=grammar)
    g = specdec.assemble(model, tok, "none").grammar_state(specdec.Request(grammar=grammar))
    assert joint
    for seq in joint:
        assert g.advance(seq) == 2, [tok.decode([t]) for t in seq]
        g.undo()


def test_logprobs_under_a_grammar_are_finite(model, tok, prompt):
    """Masked rows leave fewer alternatives than asked for: only finite ones are given."""
    import math

    pipe = specdec.assemble(model, tok, "forced")
    out = list(pipe.stream(prompt, max_tokens=30, grammar=GRAMMARS["json_schema"], logprobs=5))
    assert any(len(r.top_logprobs) < 5 for r in out if r.top_logprobs is not None)
    for r in out:
        assert math.isfinite(r.logprob)
        assert all(math.isfinite(v) for _, v in r.top_logprobs)


def test_a_batch_without_rollback_does_not_draft_forced_tokens(tok, prompt):
    """A batch whose sliding-window layers have no per-row rollback (speculation off):
    its constrained rows draft nothing, so a row with a grammar and one without both
    finish, each equal to its request alone."""
    gemma = make_tiny_model("gemma3", vocab_size=VOCAB)
    with plugin_host(OneAmountPlugin()) as host:
        pol = specdec.Policy(name="forced-one", forced_drafts=True, rollback="one_amount")
        spec = specdec.assemble(gemma, tok, pol, host=host)
    plain = specdec.assemble(gemma, tok, "none")
    batch = spec.batch(2)
    assert batch.off_reason is not None
    rows = {batch.add(prompt, max_tokens=20, grammar=GRAMMARS["lark"]): 0}
    rows[batch.add(prompt[3:], max_tokens=20)] = 1
    got: dict[int, list[int]] = {0: [], 1: []}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            if not ev.response.is_stop_token:
                got[rows[ev.row]].append(ev.response.token)
            if ev.response.stats is not None:
                assert ev.response.stats.drafted == 0
    assert got[0] == plain.generate(prompt, max_tokens=20, grammar=GRAMMARS["lark"]).tokens
    assert got[1] == plain.generate(prompt[3:], max_tokens=20).tokens
