"""Log-probabilities of emitted tokens: the target's own, under speculation as in plain
decoding and as mlx-lm reports them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.generate import generate_step
from specdec.testing import copy_heavy_prompt, make_tiny_model

TOL = 1e-4


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def prompt(llama):
    return copy_heavy_prompt(llama, [3, 9, 4, 17], n=20)


def _stream(pipe, prompt, **kw):
    return [r for r in pipe.stream(prompt, **kw)]


def test_plain_logprobs_are_mlx_lms(llama, prompt):
    pipe = specdec.assemble(llama, None, "none")
    got = _stream(pipe, prompt, max_tokens=12, logprobs=5)
    ref = list(generate_step(mx.array(prompt), llama, max_tokens=len(got)))
    assert [r.token for r in got] == [int(t) for t, _ in ref]
    for g, (_, logprobs) in zip(got, ref):
        lp = np.array(logprobs, dtype=np.float64)
        assert abs(g.logprob - lp[g.token]) < TOL
        top = np.argsort(-lp)[:5]
        assert [t for t, _ in g.top_logprobs] == top.tolist()
        assert np.allclose([v for _, v in g.top_logprobs], lp[top], atol=TOL)
        assert g.top_logprobs[0][1] >= g.top_logprobs[-1][1]


@pytest.mark.parametrize("policy", ["ngram", "copy"])
def test_speculated_tokens_carry_the_plain_logprobs(llama, prompt, policy):
    plain = _stream(specdec.assemble(llama, None, "none"), prompt, max_tokens=30, logprobs=3)
    spec = _stream(specdec.assemble(llama, None, policy), prompt, max_tokens=30, logprobs=3)
    assert spec[-1].stats.accepted > 0  # drafts were proposed and accepted
    assert any(r.from_draft for r in spec)
    assert [r.token for r in spec] == [r.token for r in plain]
    for s, p in zip(spec, plain):
        assert abs(s.logprob - p.logprob) < TOL, s.position
        assert [t for t, _ in s.top_logprobs] == [t for t, _ in p.top_logprobs]


def test_rows_of_a_batch_carry_their_logprobs(llama, prompt):
    prompts = [prompt, prompt[5:], copy_heavy_prompt(llama, [5, 2, 8], n=14)]
    plain = specdec.assemble(llama, None, "none")
    batch = specdec.assemble(llama, None, "ngram").batch(3)
    rows = {batch.add(p, max_tokens=16, logprobs=2): p for p in prompts}
    got: dict = {rid: [] for rid in rows}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None
            got[ev.row].append(ev.response)
    assert any(r.from_draft for rs in got.values() for r in rs)
    for rid, p in rows.items():
        want = _stream(plain, p, max_tokens=16, logprobs=2)
        assert [r.token for r in got[rid]] == [r.token for r in want]
        for g, w in zip(got[rid], want):
            assert abs(g.logprob - w.logprob) < TOL
            assert len(g.top_logprobs) == 2


def test_logprobs_follow_the_logits_processors(llama, prompt):
    kw = dict(max_tokens=12, logprobs=0, repetition_penalty=1.3)
    plain = _stream(specdec.assemble(llama, None, "none"), prompt, **kw)
    spec = _stream(specdec.assemble(llama, None, "ngram"), prompt, **kw)
    assert [r.token for r in spec] == [r.token for r in plain]
    assert all(r.top_logprobs == () for r in spec)
    assert np.allclose([r.logprob for r in spec], [r.logprob for r in plain], atol=TOL)
    # without the penalty the same tokens are likelier or as likely under the raw logits
    off = _stream(specdec.assemble(llama, None, "none"), prompt, max_tokens=12)
    assert all(r.logprob is None and r.top_logprobs is None for r in off)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_bad_logprobs_are_refused_before_model_work(llama, prompt, bad):
    pipe = specdec.assemble(llama, None, "none")
    with pytest.raises(specdec.RequestError, match="logprobs must be None"):
        pipe.check_request(logprobs=bad)
