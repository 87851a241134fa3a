"""Structured output: ``response_format`` (json_object, json_schema), the ``grammar`` field
(regex, Lark) and ``tool_choice`` required / a named function, enforced by the core's
constrained decoding (``Request.grammar``) under speculation; bad schemas are 400s before
any model work."""

from __future__ import annotations

import json
import re

import httpx
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
    },
    "required": ["name", "city", "age"],
    "additionalProperties": False,
}
DOC = "Alice Johnson is 34 years old and lives in Portland, Oregon."
MESSAGES = [{"role": "user", "content": f"Extract name, city and age as JSON.\n\n{DOC}"}]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 30}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("policy", ["none", "copy"])
def test_response_format_json_schema(server, client, policy):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model=server[1].model_name,
        messages=MESSAGES,
        max_tokens=80,
        response_format=fmt,
        extra_body={"policy": policy},
    )
    out = json.loads(r.choices[0].message.content)
    assert set(out) == {"name", "city", "age"} and isinstance(out["age"], int)
    assert r.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(
        model=server[1].model_name,
        messages=MESSAGES,
        max_tokens=80,
        response_format=fmt,
        stream=True,
        extra_body={"policy": policy},
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content


def test_response_format_is_the_same_under_speculation(server, client):
    """Greedy constrained output under ``copy`` equals constrained plain decoding."""
    outs = []
    for policy in ("none", "copy"):
        r = client.chat.completions.create(
            model=server[1].model_name,
            messages=MESSAGES,
            max_tokens=60,
            response_format={"type": "json_object"},
            extra_body={"policy": policy},
        )
        outs.append(r.choices[0].message.content)
    assert isinstance(json.loads(outs[0]), dict) and outs[0] == outs[1]


def test_grammar_field_and_completions(server):
    base, _ = server
    r = httpx.post(
        base + "/v1/completions",
        json={"prompt": "Answer yes or no:", "max_tokens": 12, "grammar": {"regex": "(yes|no)!"}},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch("(yes|no)!", r.json()["choices"][0]["text"])
    lark = 'start: "[" n ("," n)* "]"\nn: /[0-9]{1,3}/'
    r = httpx.post(
        base + "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 30, "grammar": {"lark": lark}},
        timeout=120,
    )
    assert re.fullmatch(
        r"\[[0-9]{1,3}(,[0-9]{1,3})*\]", r.json()["choices"][0]["message"]["content"]
    )


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "Invalid type: foo",
        ),
        ({"grammar": {"regex": "("}}, "unclosed group"),
        ({"grammar": {"xml": "x"}}, "grammar must be one of"),
        ({"grammar": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
    ],
)
def test_bad_structured_requests_are_400s(server, extra, needle):
    base, engine = server
    before = engine.prefix.stats()
    body = {"messages": MESSAGES, "max_tokens": 5, **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert engine.prefix.stats() == before  # nothing ran
    assert httpx.get(base + "/health").status_code == 200


@pytest.mark.parametrize("policy", ["none", "copy"])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_returns_a_valid_call(tool_server, policy, stream):
    """Even the 135M default model returns a valid call when one is required."""
    _, _, client = tool_server
    kw = dict(
        model="tools",
        messages=[{"role": "user", "content": "Hello! How are you today?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        extra_body={"policy": policy},
    )
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        name, args = call.function.name, json.loads(call.function.arguments)
    else:
        calls, finish = [], None
        for c in client.chat.completions.create(**kw, stream=True):
            if c.choices and c.choices[0].delta.tool_calls:
                calls += c.choices[0].delta.tool_calls
            if c.choices and c.choices[0].finish_reason:
                finish = c.choices[0].finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        name, args = calls[0].function.name, json.loads(calls[0].function.arguments)
    assert name in ("get_weather", "get_time")
    assert set(args) == ({"city"} if name == "get_weather" else {"zone"})


def test_tool_choice_named_function(tool_server):
    _, _, client = tool_server
    r = client.chat.completions.create(
        model="tools",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET", "PST")


def test_anthropic_tool_choice_any_and_tool(tool_server):
    import anthropic

    base, _, _ = tool_server
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    kw = dict(model="tools", max_tokens=60, tools=tools)
    msgs = [{"role": "user", "content": "Hi there!"}]
    m = ant.messages.create(**kw, messages=msgs, tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name in ("get_weather", "get_time")
    m = ant.messages.create(**kw, messages=msgs, tool_choice={"type": "tool", "name": "get_time"})
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET", "PST")


def test_concurrent_structured_requests_share_the_batch(server):
    """Clients with different formats at once: rows of one batch, each equal to the
    request served alone."""
    import concurrent.futures

    base, engine = server
    bodies = [
        {"messages": MESSAGES, "max_tokens": 60, "response_format": {"type": "json_object"}},
        {"messages": MESSAGES, "max_tokens": 40},
        {"prompt": "Answer yes or no:", "max_tokens": 8, "grammar": {"regex": "(yes|no)!"}},
        {
            "messages": MESSAGES,
            "max_tokens": 80,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA},
            },
        },
    ]

    def post(body):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(base + path, json={**body, "policy": "copy"}, timeout=300)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if "message" in c else c["text"]

    alone = [post(b) for b in bodies]
    rounds_before = engine.batches["copy"].rounds if "copy" in engine.batches else 0
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        together = list(ex.map(post, bodies))
    assert together == alone
    assert engine.batches["copy"].rounds > rounds_before
    assert isinstance(json.loads(alone[0]), dict) and re.fullmatch("(yes|no)!", alone[2])


def test_forced_call_schema_keeps_the_tools_refs():
    """A tool whose parameters use ``$defs`` / ``definitions`` (as pydantic writes them):
    nested in the call's schema, its refs still resolve."""
    import types

    import specdec
    from specdec_serve.tools import JSON_CALLS, call_grammar

    def parser(text, tools):  # pragma: no cover - only its module is read
        return None

    parser.__module__ = JSON_CALLS
    tok = types.SimpleNamespace(
        tool_parser=parser, tool_call_start="<tool_call>", tool_call_end="</tool_call>"
    )
    city = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "a",
                "parameters": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "$defs": {"City": city},
                    "type": "object",
                    "properties": {"city": {"$ref": "#/$defs/City"}},
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "b",
                "parameters": {
                    "definitions": {"City": {"type": "string"}},
                    "type": "object",
                    "properties": {"to": {"$ref": "#/definitions/City"}},
                },
            },
        },
    ]
    g = specdec.Request(grammar=call_grammar(tools, ["a", "b"], tok, "m")).grammar
    assert "tool0_City" in g.source and "tool1_City" in g.source
