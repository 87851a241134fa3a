"""specdec serve against the official openai client, on 127.0.0.1, with the default model."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import openai
import pytest
import specdec

COPY_PROMPT = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."


def _alone(engine, ids, policy="none", **params):
    """The same request generated directly through the engine's pipeline."""
    out = engine.pipe(policy).generate(ids, **params)
    return out


def test_models_and_health(server, client):
    base, engine = server
    models = client.models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    h = httpx.get(base + "/health").json()
    assert (
        h["status"] == "ok" and h["default_policy"] == "none" and h["policies"] == ["none", "copy"]
    )


def test_chat_completion_equals_the_pipeline(server, client):
    _, engine = server
    msgs = [{"role": "user", "content": "Name three colors."}]
    r = client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=12)
    alone = _alone(engine, engine.chat_ids(msgs), max_tokens=12)
    assert r.choices[0].message.content == alone.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == alone.finish_reason
    assert r.usage.completion_tokens == len(alone.tokens)
    assert r.usage.prompt_tokens == len(engine.chat_ids(msgs))
    sd = r.model_extra["specdec"]
    assert sd["policy"] == "none" and sd["target_forwards"] == alone.stats.target_forwards
    assert sd["speculation_off_reason"] is not None
    # an answer that ends on the end-of-sequence token streams its whole text too (the
    # stop token's response carries the detokenizer's last flush)
    assert alone.finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=engine.model_name, messages=msgs, max_tokens=12, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text


def test_streamed_chat_has_the_same_text_and_a_final_specdec_object(server, client):
    _, engine = server
    msgs = [{"role": "user", "content": COPY_PROMPT}]
    kw = dict(model=engine.model_name, messages=msgs, max_tokens=24)
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["specdec"]["policy"] == "none"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    per_token = [
        c.model_extra["specdec"]
        for c in chunks
        if c.choices
        and not c.choices[0].finish_reason
        and "from_draft" in (c.model_extra.get("specdec") or {})
    ]
    assert len(per_token) == whole.usage.completion_tokens
    assert not any(p["from_draft"] for p in per_token)  # policy none drafts nothing


def test_per_request_policy_speculates_with_the_same_text(server, client):
    _, engine = server
    msgs = [{"role": "user", "content": COPY_PROMPT}]
    kw = dict(model=engine.model_name, messages=msgs, max_tokens=32)
    plain = client.chat.completions.create(**kw)
    spec = client.chat.completions.create(**kw, extra_body={"policy": "copy"})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    sd = spec.model_extra["specdec"]
    assert sd["policy"] == "copy" and sd["drafted"] > 0 and sd["accepted"] > 0
    assert sd["per_drafter"]["ngram_copy"]["accepted"] > 0
    assert sd["tokens_per_forward"] > 1
    streamed = list(
        client.chat.completions.create(**kw, stream=True, extra_body={"policy": "copy"})
    )
    marks = [
        c.model_extra["specdec"]["from_draft"]
        for c in streamed
        if c.choices and "from_draft" in (c.model_extra.get("specdec") or {})
    ]
    assert any(marks) and not all(marks)


def test_completions_stream_and_not(server, client):
    _, engine = server
    prompt = "The capital of France is"
    whole = client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8)
    alone = _alone(engine, engine.text_ids(prompt), max_tokens=8)
    assert whole.choices[0].text == alone.text and whole.object == "text_completion"
    parts = list(
        client.completions.create(model=engine.model_name, prompt=prompt, max_tokens=8, stream=True)
    )
    assert "".join(c.choices[0].text for c in parts if c.choices) == alone.text


def test_stop_sequences_and_seeded_sampling(server, client):
    _, engine = server
    msgs = [{"role": "user", "content": "Count from one to ten, separated by commas."}]
    full = client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=30)
    text = full.choices[0].message.content
    k = len(text) // 2
    stop = text[k : k + 2]  # a string from the middle of the answer
    cut = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=30, stop=[stop, "never-seen"]
    )
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    a = client.chat.completions.create(
        model=engine.model_name, messages=msgs, max_tokens=10, temperature=0.9, seed=7, top_p=0.95
    )
    b = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=10,
        temperature=0.9,
        seed=7,
        top_p=0.95,
        extra_body={"policy": "copy"},
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_penalties_and_logit_bias_reach_the_pipeline(server, client):
    _, engine = server
    msgs = [{"role": "user", "content": "Name three colors."}]
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5, logit_bias={17: 5.0})
    r = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=10,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        logit_bias={"17": 5.0},
    )
    alone = _alone(engine, engine.chat_ids(msgs), max_tokens=10, **kw)
    plain = _alone(engine, engine.chat_ids(msgs), max_tokens=10)
    assert r.choices[0].message.content == alone.text != plain.text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (
            {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
            404,
            "not served here",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            400,
            "max_tokens must be an integer >= 1",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            400,
            "temperature must be >= 0",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "policy": "fastest"},
            400,
            "unknown policy 'fastest'",
        ),
        ({"messages": []}, 400, "messages must be a non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n must be 1"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "xml"},
            },
            400,
            "response_format must be",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3},
            400,
            "presence_penalty must be in [-2, 2]",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}},
            400,
            "logit_bias must map",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "policy": "draft"},
            400,
            "cannot run on this server",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream must be"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "stream_options": [1]},
            400,
            "stream_options must be an object",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "top_k": -3}, 400, "top_k must be"),
        ({"messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400, "min_p must be in"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, needle):
    base, _ = server
    r = httpx.post(base + "/v1/chat/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_malformed_json_and_an_overlong_prompt(server, client):
    base, engine = server
    nan = b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    r = httpx.post(
        base + "/v1/chat/completions", content=nan, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    r = httpx.post(
        base + "/v1/chat/completions",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    too_long = [1] * (engine.context_length + 1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=engine.model_name, prompt=too_long, max_tokens=4)
    assert "context" in str(e.value)
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_an_error_inside_a_round_fails_that_request_only(server, client, monkeypatch):
    base, engine = server
    batch = engine.batches["none"]
    real = batch._accept

    def broken(row, rnd, logits):
        if row.request.max_tokens == 7 and row.emitter.n_out >= 2:
            raise RuntimeError("injected failure")
        return real(row, rnd, logits)

    monkeypatch.setattr(batch, "_accept", broken)
    story = [{"role": "user", "content": "Tell me about the sea."}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = pool.submit(
            client.chat.completions.create,
            model=engine.model_name,
            messages=story,
            max_tokens=40,
        )
        time.sleep(0.5)  # the long request is decoding when the failing one joins
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(
                model=engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=7
            )
        got = long.result(timeout=120)
    assert "injected failure" in str(e.value)
    monkeypatch.undo()
    # the row that shared the batch with the failing one is what it would be alone
    assert (
        got.choices[0].message.content == _alone(engine, engine.chat_ids(story), max_tokens=40).text
    )
    assert "specdec_failed_requests_total 1" in httpx.get(base + "/metrics").text


def test_concurrent_requests_are_decoded_as_rows_of_one_batch(server, client):
    _, engine = server
    msgs = [
        [{"role": "user", "content": COPY_PROMPT}],
        [{"role": "user", "content": "Repeat exactly: one two three four five six seven."}],
    ]

    def one(m):
        return client.chat.completions.create(
            model=engine.model_name, messages=m, max_tokens=24, extra_body={"policy": "copy"}
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(one, msgs))
    rows = [r.model_extra["specdec"]["batch_rows"] for r in got]
    assert any(int(k) >= 2 for r in rows for k in r), rows
    assert any(r.model_extra["specdec"]["accepted"] for r in got)
    for m, r in zip(msgs, got):
        want = _alone(engine, engine.chat_ids(m), max_tokens=24).text
        assert r.choices[0].message.content == want


def test_a_client_that_disconnects_frees_the_worker(server, client):
    base, engine = server
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
        "max_tokens": 400,
        "stream": True,
    }
    before = _metric(httpx.get(base + "/metrics").text, "specdec_cancelled_requests_total")
    with httpx.stream("POST", base + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and "from_draft" in line:
                break  # one token arrived: go away
    t = time.perf_counter()
    ok = client.chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    waited = time.perf_counter() - t
    assert ok.usage.completion_tokens >= 1
    assert (
        _metric(httpx.get(base + "/metrics").text, "specdec_cancelled_requests_total") == before + 1
    )
    assert waited < 20  # not the 400 tokens of the story (about 25 s here)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_are_prometheus_text(server, client):
    base, _ = server
    client.chat.completions.create(
        model=server[1].model_name,
        messages=[{"role": "user", "content": COPY_PROMPT}],
        max_tokens=16,
        extra_body={"policy": "copy"},
    )
    text = httpx.get(base + "/metrics").text
    for name in (
        "specdec_requests_total",
        "specdec_queue_length",
        "specdec_generated_tokens_total",
        "specdec_target_forwards_total",
        "specdec_drafted_tokens_total",
        "specdec_accepted_tokens_total",
        "specdec_round_seconds_sum",
        "specdec_round_seconds_count",
    ):
        assert f"\n{name}" in "\n" + text, name
    assert 'specdec_drafted_tokens_total{drafter="ngram_copy"}' in text
    assert 'specdec_requests_total{endpoint="/v1/chat/completions",code="200"}' in text
    for line in text.splitlines():  # every sample line is NAME[{labels}] VALUE
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_the_page_is_served(server):
    base, engine = server
    r = httpx.get(base + "/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    assert (
        engine.model_name in r.text
        and "/v1/chat/completions" in r.text
        and 'class="draft"' in r.text
    )


def test_concurrent_streaming_clients_get_what_they_would_alone(server, client):
    base, engine = server
    prompts = [f"Say the word number {i} times: hello." for i in range(8)]

    def one(i: int) -> tuple[str, int]:
        p = prompts[i % len(prompts)]
        stream = list(
            client.chat.completions.create(
                model=engine.model_name,
                messages=[{"role": "user", "content": p}],
                max_tokens=8,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"policy": "copy" if i % 2 else "none"},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return text, stream[-1].usage.completion_tokens

    n_req = 16
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(n_req)))
    elapsed = time.perf_counter() - t
    for i, (text, _) in enumerate(got):
        msgs = [{"role": "user", "content": prompts[i % len(prompts)]}]
        assert text == _alone(engine, engine.chat_ids(msgs), max_tokens=8).text, i
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["queue_length"] == 0
    tokens = sum(n for _, n in got)
    print(
        f"\nload: {n_req} requests from 8 clients in {elapsed:.1f} s: {n_req / elapsed:.2f} req/s, "
        f"{tokens} tokens, {tokens / elapsed:.1f} tok/s aggregate"
    )


def test_serve_command_checks_its_arguments(capsys):
    from specdec.cli import main

    assert main(["serve", "--policy", "no-such-policy"]) == 2
    assert "no-such-policy" in capsys.readouterr().err
    assert main(["serve", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--profile-context", "-1"]) == 2
    assert "--profile-context must be >= 0" in capsys.readouterr().err
    assert main(["serve", "--prompt-cache-size", "0"]) == 2
    assert "--prompt-cache-size must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--prompt-cache-bytes", "lots"]) == 2
    assert main(["serve", "--prompt-cache-bytes", "inf"]) == 2
    assert main(["serve", "--max-body-bytes", "0"]) == 2
    assert "expected a byte count such as 2G" in capsys.readouterr().err
    from specdec_serve.plugin import _size

    assert _size("2G") == 2 << 30 and _size("512M") == 512 << 20 and _size("1000") == 1000


def test_entry_point():
    specdec.testing.require_installed("specdec-plugin-serve")
    assert "serve" in json.dumps(specdec.get_plugin_host().to_dict())


def test_a_body_over_the_size_limit_is_a_413_before_it_is_read(server):
    from specdec_serve import make_app
    from starlette.testclient import TestClient

    _, engine = server
    with TestClient(make_app(engine, max_body_bytes=2000)) as c:
        big = {"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": 2}
        r = c.post("/v1/chat/completions", json=big)
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "2000 bytes" in err["message"]
        # chunked, without a content-length: cut off as it streams in
        r = c.post(
            "/v1/completions",
            content=iter([b'{"prompt": "', b"y" * 2500, b'", "max_tokens": 2}']),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 413
        small = {"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 2}
        assert c.post("/v1/chat/completions", json=small).status_code == 200
