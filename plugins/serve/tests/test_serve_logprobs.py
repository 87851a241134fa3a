"""logprobs / top_logprobs: the target's own, equal to plain decoding's under speculation."""

from __future__ import annotations

import httpx
import pytest

COPY = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."


def _plain(engine, ids, n, k):
    return [
        r for r in engine.pipe("none").stream(ids, max_tokens=n, logprobs=k) if not r.is_stop_token
    ]


@pytest.mark.parametrize("policy", ["none", "copy"])
def test_chat_logprobs_are_plain_decodings(server, client, policy):
    _, engine = server
    msgs = [{"role": "user", "content": COPY}]
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=20,
        logprobs=True,
        top_logprobs=3,
        extra_body={"policy": policy},
    )
    want = _plain(engine, engine.chat_ids(msgs), 20, 3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == len(want)
    for c, w in zip(content, want):
        assert c.token == engine.tokenizer.decode([w.token])
        assert abs(c.logprob - w.logprob) < 1e-4
        assert bytes(c.bytes) == c.token.encode("utf-8")
        assert [t.token for t in c.top_logprobs] == [
            engine.tokenizer.decode([t]) for t, _ in w.top_logprobs
        ]
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # the likeliest first
    if policy == "copy":
        assert r.model_extra["specdec"]["accepted"] > 0
    # streamed: one entry per token chunk, the same values
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=20,
        logprobs=True,
        top_logprobs=3,
        stream=True,
        extra_body={"policy": policy},
    )
    streamed = [
        e
        for ch in stream
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [
        (e.token, round(e.logprob, 5)) for e in content
    ]


def test_no_logprobs_unless_asked(server, client):
    _, engine = server
    r = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "Hi."}], max_tokens=4
    )
    assert r.choices[0].logprobs is None


def test_completions_logprobs(server, client):
    _, engine = server
    prompt = "Fruits: apples, pears, plums, apples, pears, plums, apples,"
    r = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=10, logprobs=2)
    lp = r.choices[0].logprobs
    want = _plain(engine, engine.text_ids(prompt), 10, 2)
    assert len(want) == 10
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(want)
    assert all(abs(a - w.logprob) < 1e-4 for a, w in zip(lp.token_logprobs, want))
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[-1] <= len(r.choices[0].text)


@pytest.mark.parametrize(
    "path,extra,needle",
    [
        (
            "chat/completions",
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs must be an integer in [0, 20]",
        ),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("chat/completions", {"logprobs": "yes"}, "logprobs must be true or false"),
        ("completions", {"logprobs": -1}, "logprobs must be an integer in [0, 20]"),
        ("completions", {"logprobs": 2, "top_logprobs": 2}, "top_logprobs is a chat field"),
    ],
)
def test_bad_logprobs_are_400s(server, path, extra, needle):
    base, _ = server
    body = {"max_tokens": 3, **extra}
    if path == "completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{base}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert httpx.get(base + "/health").status_code == 200
