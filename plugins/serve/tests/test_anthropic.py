"""specdec serve's Anthropic Messages API against the official anthropic client."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from anthropic.types import Message

COPY_PROMPT = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"  # answered in 9 tokens, then end of turn


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0)


def _alone(engine, msgs, policy="none", **params):
    """The same request generated directly through the engine's pipeline."""
    return engine.pipe(policy).generate(engine.chat_ids(msgs), **params)


def _still_serving(ant, engine):
    m = ant.messages.create(
        model=engine.model_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
    )
    assert m.type == "message" and m.usage.output_tokens >= 1


def test_message_equals_the_pipeline(server, ant):
    _, engine = server
    user = QUESTION
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    m = ant.messages.create(
        model=engine.model_name,
        max_tokens=40,
        system=SYSTEM,
        messages=[{"role": "user", "content": user}],
    )
    alone = _alone(engine, msgs, max_tokens=40)
    assert alone.finish_reason == "stop"  # the model ended its turn
    assert isinstance(m, Message)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == engine.model_name
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == alone.text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    n_prompt = len(engine.chat_ids(msgs))
    assert m.usage.output_tokens == len(alone.tokens)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n_prompt
    assert m.usage.cache_creation_input_tokens == 0
    sd = m.model_extra["specdec"]
    assert sd["policy"] == "none" and sd["target_forwards"] == alone.stats.target_forwards
    # system and content as lists of text blocks: the same prompt, the same answer
    again = ant.messages.create(
        model=engine.model_name,
        max_tokens=40,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": user}]}],
    )
    assert again.content[0].text == alone.text
    # the second time, the prompt came from the prefix cache (all of it but its last token)
    assert again.usage.cache_read_input_tokens == n_prompt - 1
    assert again.usage.input_tokens == 1


def test_text_blocks_are_joined_and_a_conversation_runs(server, ant):
    _, engine = server
    conv = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi."}, {"type": "text", "text": "Who are you?"}],
        },
        {"role": "assistant", "content": "I am a small model."},
        {"role": "user", "content": "Name a fruit."},
    ]
    m = ant.messages.create(model=engine.model_name, max_tokens=16, messages=conv)
    msgs = [
        {"role": "user", "content": "Hi.\nWho are you?"},
        {"role": "assistant", "content": "I am a small model."},
        {"role": "user", "content": "Name a fruit."},
    ]
    assert m.content[0].text == _alone(engine, msgs, max_tokens=16).text


def test_streaming_gives_the_same_text_and_final_message(server, ant):
    _, engine = server
    kw = dict(
        model=engine.model_name,
        max_tokens=40,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
    )
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert final.stop_sequence is None
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == total
    assert final.id.startswith("msg_") and final.model == engine.model_name


def test_stream_events_on_the_wire(server):
    base, engine = server
    body = {
        "model": engine.model_name,
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": COPY_PROMPT}],
    }
    events = []
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == kind[len("event: ") :]
        events.append(payload)
    kinds = [e["type"] for e in events]
    n_deltas = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * n_deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == len(
        engine.chat_ids(body["messages"])
    )
    assert events[1]["content_block"] == {"type": "text", "text": ""} and events[1]["index"] == 0
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for d in deltas)
    text = "".join(d["delta"]["text"] for d in deltas)
    assert text == _alone(engine, body["messages"], max_tokens=8).text
    end = events[-2]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 8
    assert end["specdec"]["policy"] == "none"


def test_copy_policy_speculates_with_the_same_text(server, ant):
    _, engine = server
    msgs = [{"role": "user", "content": COPY_PROMPT}]
    m = ant.messages.create(
        model=engine.model_name, max_tokens=24, messages=msgs, extra_body={"policy": "copy"}
    )
    assert m.content[0].text == _alone(engine, msgs, max_tokens=24).text
    sd = m.model_extra["specdec"]
    assert sd["policy"] == "copy" and sd["accepted"] > 0 and sd["drafted"] >= sd["accepted"]
    assert sd["tokens_per_forward"] > 1
    with ant.messages.stream(
        model=engine.model_name, max_tokens=24, messages=msgs, extra_body={"policy": "copy"}
    ) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text and final.stop_reason == m.stop_reason


def test_stop_sequences(server, ant):
    _, engine = server
    msgs = [{"role": "user", "content": COPY_PROMPT}]
    plain = _alone(engine, msgs, max_tokens=24).text
    stop = "pears"
    assert stop in plain
    kw = dict(model=engine.model_name, max_tokens=24, messages=msgs)
    m = ant.messages.create(**kw, stop_sequences=["no such text", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == plain[: plain.find(stop)]
    # two found: the one that comes first in the text
    assert "plums" in plain and "apples" in plain
    m2 = ant.messages.create(**kw, stop_sequences=["plums", "apples"])
    first = min(("plums", "apples"), key=plain.find)
    assert m2.stop_sequence == first and m2.content[0].text == plain[: plain.find(first)]
    with ant.messages.stream(**kw, stop_sequences=[stop], extra_body={"policy": "copy"}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_max_tokens_reached(server, ant):
    _, engine = server
    m = ant.messages.create(
        model=engine.model_name,
        max_tokens=3,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    )
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 3


def _post(ant, body):
    return ant.post("/v1/messages", cast_to=Message, body=body)


@pytest.mark.parametrize(
    "change, error, needle",
    [
        ({"max_tokens": None}, anthropic.BadRequestError, "max_tokens"),
        (
            {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}]},
            anthropic.BadRequestError,
            "top-level system field",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, anthropic.BadRequestError, "role"),
        (
            {
                "messages": [
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t1", "name": "get", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}],
                    },
                ]
            },
            anthropic.BadRequestError,
            "cannot render tool_use / tool_result blocks",  # no tool format in its template
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                            }
                        ],
                    }
                ]
            },
            anthropic.BadRequestError,
            "image",
        ),
        (
            {"tools": [{"name": "get", "input_schema": {"type": "object"}}]},
            anthropic.BadRequestError,
            "has no tool-call format",
        ),
        (
            {"tool_choice": {"type": "any"}},
            anthropic.BadRequestError,
            "tool_choice 'required' needs tools",
        ),
        ({"mcp_servers": [{"type": "url", "url": "x"}]}, anthropic.BadRequestError, "mcp_servers"),
        ({"model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
        ({"model": None}, anthropic.BadRequestError, "model"),
        ({"temperature": 1.5}, anthropic.BadRequestError, "temperature must be in [0, 1]"),
        ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens must be"),
        ({"top_p": 0}, anthropic.BadRequestError, "top_p"),
        ({"stop_sequences": "x"}, anthropic.BadRequestError, "stop_sequences"),
        ({"stream": "yes"}, anthropic.BadRequestError, "stream must be"),
        ({"policy": "no-such-policy"}, anthropic.BadRequestError, "unknown policy"),
        ({"messages": []}, anthropic.BadRequestError, "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "A"},
                ]
            },
            anthropic.BadRequestError,
            "prefilling",
        ),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            anthropic.BadRequestError,
            "thinking",
        ),
    ],
)
def test_bad_requests_get_anthropic_errors(server, ant, monkeypatch, change, error, needle):
    _, engine = server
    queued = []
    monkeypatch.setattr(engine, "submit", queued.append)  # nothing may be queued
    body = {
        "model": engine.model_name,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        **change,
    }
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(error) as e:
        _post(ant, body)
    assert e.value.status_code == (404 if error is anthropic.NotFoundError else 400)
    assert e.value.body["type"] == "error"
    kind = "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
    assert e.value.body["error"]["type"] == kind
    assert needle in e.value.body["error"]["message"]
    assert queued == []  # refused before anything was queued
    monkeypatch.undo()
    _still_serving(ant, engine)


def test_malformed_json(server, ant):
    _, engine = server
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.post(
            "/v1/messages",
            cast_to=Message,
            content=b"{not json",
            options={"headers": {"Content-Type": "application/json"}},
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in e.value.body["error"]["message"]
    _still_serving(ant, engine)


def test_a_failure_in_generation_is_an_api_error(server, ant, monkeypatch):
    _, engine = server

    def fail(job):  # what the worker hands a request whose generation raised
        job.emit(("error", RuntimeError("injected failure")))

    monkeypatch.setattr(engine, "submit", fail)
    kw = dict(model=engine.model_name, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.InternalServerError) as e:
        ant.messages.create(**kw)
    assert e.value.body["error"]["type"] == "api_error"
    assert "injected failure" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.APIStatusError) as e2:  # in a stream: an error event
        with ant.messages.stream(**kw) as s:
            list(s.text_stream)
    assert e2.value.body["type"] == "error" and e2.value.body["error"]["type"] == "api_error"
    assert "injected failure" in e2.value.body["error"]["message"]
    monkeypatch.undo()
    _still_serving(ant, engine)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_client_that_disconnects_cancels_its_job(server, ant):
    base, engine = server
    before = _metric(httpx.get(base + "/metrics").text, "specdec_cancelled_requests_total")
    with ant.messages.stream(
        model=engine.model_name,
        max_tokens=400,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
    ) as s:
        for _ in s.text_stream:
            break  # one token arrived: go away
    t = time.perf_counter()
    _still_serving(ant, engine)
    waited = time.perf_counter() - t
    deadline = time.time() + 20
    while (
        _metric(httpx.get(base + "/metrics").text, "specdec_cancelled_requests_total") == before
        and time.time() < deadline
    ):
        time.sleep(0.1)
    assert (
        _metric(httpx.get(base + "/metrics").text, "specdec_cancelled_requests_total") == before + 1
    )
    assert waited < 20  # not the 400 tokens of the story
    assert 'endpoint="/v1/messages",code="200"' in httpx.get(base + "/metrics").text
