"""A buggy drafter never crashes the process or silently changes the output (issue 42):
every draft is checked before it reaches the model, every component's exception is
named, options of the wrong type fail at assembly, and the kit's fault check runs on
the core's own drafters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import specdec
from specdec.testing import (
    FAULTS,
    check_drafter_faults,
    find_copy_prompt,
    make_tiny_model,
    plugin_host,
)


class _Bad(specdec.BaseDrafter):
    """Proposes ``(last, bad)``: a copy of the last token and then ``bad``."""

    name = "bad"
    supports_batch = True

    def __init__(self, bad: int = 0):
        self.bad = bad

    def session(self, ctx):
        return _BadSession(self.bad)


class _BadSession(specdec.BaseDrafterSession):
    def __init__(self, bad):
        self.bad = bad

    def propose(self, history, max_len):
        return specdec.Draft(tokens=[history[-1], self.bad][:max_len])


class _Raises(specdec.BaseDrafter):
    name = "raises"

    def session(self, ctx):
        return _RaisesSession()


class _RaisesSession(specdec.BaseDrafterSession):
    def __init__(self):
        self.calls = 0

    def propose(self, history, max_len):
        self.calls += 1
        if self.calls == 2:
            raise KeyError("no such line")
        return specdec.Draft(tokens=[history[-1]])


class _Typed(specdec.BaseDrafter):
    """Options taken as keyword parameters, with no declaration of their own."""

    name = "typed"

    def __init__(self, max_len: int = 4, ratio=0.5, label: str | None = None):
        self.max_len = max_len

    def session(self, ctx):
        return _BadSession(0)


class _Plugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("bad", _Bad)
        register("raises", _Raises)
        register("typed", _Typed)


PROMPT = [1, 2, 3, 4, 5]


def test_an_id_far_outside_the_vocabulary_is_an_error_not_a_crash():
    # Before: the embedding gather read out of bounds and the process died (exit 139).
    # In a subprocess, so that a regression fails this test instead of killing the run.
    code = textwrap.dedent(
        """
        import specdec
        from specdec.testing import make_tiny_model, plugin_host

        class Bad(specdec.BaseDrafter):
            name = "bad"

            def __init__(self, bad=0):
                self.bad = bad

            def session(self, ctx):
                return BadSession(self.bad)

        class BadSession(specdec.BaseDrafterSession):
            def __init__(self, bad):
                self.bad = bad

            def propose(self, history, max_len):
                return specdec.Draft(tokens=[history[-1], self.bad][:max_len])

        class Plugin:
            @specdec.hookimpl
            def specdec_register_drafters(self, register):
                register("bad", Bad)

        with plugin_host(Plugin(), load_entry_points=False) as host:
            pol = {"drafters": ["bad"], "options": {"bad": {"bad": 1_000_000}}}
            pipe = specdec.assemble(make_tiny_model("llama"), policy=pol, host=host)
            try:
                pipe.generate([1, 2, 3, 4, 5], max_tokens=8, temperature=0.0)
            except specdec.DraftError as exc:
                print("DraftError:", exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-2000:]}"
    assert "DraftError: drafter 'bad' (test" in out.stdout, out.stdout
    assert "token id 1000000 at index 1" in out.stdout
    assert "outside the vocabulary [0, 64)" in out.stdout


@pytest.mark.parametrize("bad", [64, -1])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_id_at_the_vocabulary_size_or_negative_never_reaches_the_model(bad, temperature):
    # Before: id 64 on a 64-token vocabulary at temperature 1 gave wrong output on
    # every seed, with no error; 64 and -1 passed greedy runs unnoticed.
    model = make_tiny_model("llama")
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        pol = {"drafters": ["bad"], "options": {"bad": {"bad": bad}}}
        pipe = specdec.assemble(model, policy=pol, host=host)
        plain = specdec.assemble(model, policy="none", host=host)
        for seed in range(3):
            with pytest.raises(specdec.DraftError) as e:
                pipe.generate(PROMPT, max_tokens=12, temperature=temperature, seed=seed)
            err = e.value
            assert err.component == "bad" and err.role == "drafter" and err.round == 1
            assert err.position == len(PROMPT)
            assert f"token id {bad} at index 1" in str(err)
        # the pipeline serves the next request, as plain decoding does
        pipe_ok = specdec.assemble(model, policy={"drafters": ["bad"]}, host=host)
        kw = dict(max_tokens=12, temperature=temperature, seed=7)
        assert pipe_ok.generate(PROMPT, **kw).tokens == plain.generate(PROMPT, **kw).tokens


def test_a_session_that_raises_is_named_with_its_round_and_cause():
    model = make_tiny_model("llama")
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["raises"]}, host=host)
        plain = specdec.assemble(model, policy="none", host=host)
        with pytest.raises(specdec.ComponentError) as e:
            pipe.generate(PROMPT, max_tokens=12, temperature=0.0)
        err = e.value
        msg = str(err)
        assert "drafter 'raises' (test unknown) raised in propose() in round 2" in msg, msg
        assert "KeyError: 'no such line'" in msg
        assert isinstance(err.__cause__, KeyError)
        assert (err.component, err.call, err.round) == ("raises", "propose", 2)
        # the request is lost with that error; the pipeline serves the next one
        other = [9, 8, 7]
        pipe2 = specdec.assemble(model, policy={"drafters": ["bad"]}, host=host)
        assert (
            pipe2.generate(other, max_tokens=6).tokens == plain.generate(other, max_tokens=6).tokens
        )


def test_a_raising_row_of_a_batch_is_named_and_fails_alone():
    model = make_tiny_model("llama")
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        pol = {"drafters": ["bad"], "options": {"bad": {"bad": 64}}}
        pipe = specdec.assemble(model, policy=pol, host=host)
        batch = pipe.batch(2)
        rid = batch.add(PROMPT, max_tokens=8)
        errors = []
        while len(batch):
            errors += [ev.error for ev in batch.step() if ev.error is not None]
        assert len(errors) == 1 and isinstance(errors[0], specdec.DraftError)
        assert errors[0].component == "bad" and "outside the vocabulary" in str(errors[0])
        assert rid == 0


@pytest.mark.parametrize(
    "options, words",
    [
        ({"max_len": "8"}, "option max_len must be an integer, got '8'"),
        ({"max_len": 2.5}, "option max_len must be an integer, got 2.5"),
        ({"ratio": "high"}, "option ratio must be a number, got 'high'"),
        ({"label": 3}, "option label must be a string, got 3"),
    ],
)
def test_an_option_of_the_wrong_type_fails_at_assembly(options, words):
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        with pytest.raises(specdec.PolicyError) as e:
            specdec.assemble(
                make_tiny_model("llama"),
                policy={"drafters": ["typed"], "options": {"typed": options}},
                host=host,
            )
    assert "drafter 'typed' (test)" in str(e.value) and words in str(e.value), str(e.value)


def test_options_of_the_right_type_pass():
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        pol = {"drafters": ["typed"], "options": {"typed": {"max_len": 3, "ratio": 1}}}
        pipe = specdec.assemble(make_tiny_model("llama"), policy=pol, host=host)
        assert pipe.drafters[0].max_len == 3
        pol["options"]["typed"] = {"label": None}
        specdec.assemble(make_tiny_model("llama"), policy=pol, host=host)


def test_draft_token_ids_must_be_integers():
    with pytest.raises(TypeError, match=r"must be an integer, got 1\.5"):
        specdec.Draft(tokens=[1, 1.5])
    with pytest.raises(TypeError, match="got '3'"):
        specdec.Draft(tokens=["3"])
    import numpy as np

    assert specdec.Draft(tokens=np.array([3, 4])).tokens == (3, 4)


@pytest.mark.parametrize("policy", ["ngram", "copy"])
def test_the_fault_check_on_the_copy_drafter(models, policy):
    model = models["llama"]
    pol = specdec.load_policy(policy).with_options("ngram_copy", round_overhead=False)
    prompt = find_copy_prompt(model, pol, max_tokens=24)
    outcomes = check_drafter_faults(model, pol, prompt, max_tokens=24)
    assert [o.fault for o in outcomes] == list(FAULTS)
    assert {o.fault for o in outcomes if o.outcome == "identical"} == {"empty", "none"}


def test_the_fault_check_on_the_draft_model_drafter(models, copy_prompts):
    target = models["llama"]
    pol = specdec.Policy(
        name="draft",
        drafters=("draft_model",),
        options={"draft_model": {"model": target, "num_draft_tokens": 4}},
    )
    outcomes = check_drafter_faults(target, pol, copy_prompts["llama"], max_tokens=16)
    assert len(outcomes) == len(FAULTS)


def test_the_fault_check_fails_when_a_fault_is_never_injected(models):
    # a prompt too short for the drafter to be asked three times
    with pytest.raises(AssertionError, match="was never injected"):
        check_drafter_faults(
            models["llama"], "ngram", [1, 2, 3], faults=["raise_nth"], max_tokens=2
        )
