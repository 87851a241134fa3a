"""Tool calls: tools through the chat template, calls parsed with mlx-lm's parser,
returned and streamed as OpenAI tool_calls; refusals before any model work."""

from __future__ import annotations

import json

import httpx
import pytest
from specdec_serve.tools import CallSplitter, clean_messages, parse_call

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _few_shot(city: str = "Paris") -> list[dict]:
    """Earlier turns where the assistant answered with a call: the model copies the frame."""
    msgs: list[dict] = []
    for i, c in enumerate(["Paris", "London", "Rome"]):
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": c})},
        }
        msgs += [
            {"role": "user", "content": f"What is the weather in {c}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
    return msgs + [{"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.mark.parametrize("policy", ["none", "copy"])
def test_a_tool_call_is_parsed_and_returned(tool_server, policy):
    _, engine, client = tool_server
    assert engine.tokenizer.has_tool_calling  # mlx-lm found the format in the template
    r = client.chat.completions.create(
        model="tools",
        messages=_few_shot("Paris"),
        tools=TOOLS,
        max_tokens=40,
        extra_body={"policy": policy},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # what the model wrote: the template's frame, decoded by the plain pipeline too
    ids = engine.chat_ids(clean_messages(_few_shot("Paris")), TOOLS)
    raw = engine.pipe("none").generate(ids, max_tokens=40).text
    assert raw.startswith("<tool_call>") and raw.rstrip().endswith("</tool_call>")
    assert r.usage.prompt_tokens == len(ids)
    if policy == "copy":
        assert r.model_extra["specdec"]["accepted"] > 0


def test_a_streamed_tool_call_is_one_delta(tool_server):
    _, _, client = tool_server
    chunks = list(
        client.chat.completions.create(
            model="tools",
            messages=_few_shot("London"),
            tools=TOOLS,
            max_tokens=40,
            stream=True,
            extra_body={"policy": "copy"},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in text and "get_weather" not in text
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "London"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_tool_choice_none_renders_no_tools(tool_server):
    _, engine, client = tool_server
    msgs = [{"role": "user", "content": "Say hi."}]
    with_tools = client.chat.completions.create(
        model="tools", messages=msgs, tools=TOOLS, max_tokens=4
    )
    without = client.chat.completions.create(
        model="tools", messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    plain = client.chat.completions.create(model="tools", messages=msgs, max_tokens=4)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools' text
    assert without.choices[0].message.tool_calls is None


def test_results_of_calls_render_back_through_the_template(tool_server):
    _, engine, client = tool_server
    msgs = _few_shot("Paris")[:-1] + [
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny, 21 C"},
        {"role": "user", "content": "And now?"},
    ]
    r = client.chat.completions.create(model="tools", messages=msgs, tools=TOOLS, max_tokens=6)
    text = engine.tokenizer.decode(
        engine.chat_ids(
            [
                {
                    **m,
                    "tool_calls": [
                        {
                            **c,
                            "function": {
                                **c["function"],
                                "arguments": json.loads(c["function"]["arguments"]),
                            },
                        }
                        for c in m["tool_calls"]
                    ],
                }
                if m.get("tool_calls")
                else m
                for m in msgs
            ],
            TOOLS,
        )
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Rome"}}' in text
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "names function 'nope'",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "without response_format",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice must be"),
        ({"tools": [{"type": "function"}]}, "tools[0] must be"),
        ({"tools": TOOLS + TOOLS}, "two tools are named 'get_weather'"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "role 'wizard'"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
        ({"functions": [{"name": "f"}]}, "deprecated"),
        (
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": 5}]},
            "tool_calls must be a list",
        ),
    ],
)
def test_bad_tool_requests_are_400s(tool_server, extra, needle):
    base, engine, _ = tool_server
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 3}
    body.update(extra)
    before = engine.prefix.stats()
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert engine.prefix.stats() == before  # nothing ran
    assert httpx.get(base + "/health").status_code == 200


def test_tools_for_a_template_without_a_tool_format_are_refused(server):
    base, engine = server
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "max_tokens": 3}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "has no tool-call format" in r.json()["error"]["message"]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for msgs in (
        [{"role": "assistant", "content": None, "tool_calls": [call]}],
        [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c", "content": "1"}],
    ):
        r = httpx.post(
            base + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, timeout=60
        )
        assert r.status_code == 400 and "tool results cannot be rendered" in r.text
    r = httpx.post(
        base + "/v1/completions", json={"prompt": "hi", "tools": TOOLS, "max_tokens": 3}, timeout=60
    )
    assert r.status_code == 400 and "chat field" in r.json()["error"]["message"]


def test_the_splitter_holds_back_markers_and_drops_nothing():
    s = CallSplitter("<tool_call>", "</tool_call>")
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> done <tool'
    out = []
    for ch in text:
        out += s.feed(ch)
    out += s.finish()
    assert "".join(t for k, t in out if k == "text") == "Sure.  done <tool"
    assert [t for k, t in out if k == "call"] == ['\n{"name": "f", "arguments": {}}\n']
    s = CallSplitter("<tool_call>", "</tool_call>")
    assert s.feed("a <tool_call>{unfinished") == [("text", "a ")]
    assert s.finish() == [("text", "<tool_call>{unfinished")]
    # a format without an end marker (mlx-lm's mistral): the call runs to the end
    s = CallSplitter("[TOOL_CALLS]", "")
    out = s.feed('Ok [TOOL_CALLS][{"name": "f", ') + s.feed('"arguments": {}}]')
    assert out == [("text", "Ok ")]
    assert s.finish() == [("call", '[{"name": "f", "arguments": {}}]')]


def test_a_call_the_parser_cannot_read_is_none():
    def parser(text, tools):
        return json.loads(text)

    def broken(text, tools):
        raise RuntimeError("a parser bug")

    assert parse_call(broken, "{}", None) is None
    assert parse_call(parser, "{not json", None) is None
    assert parse_call(parser, '{"arguments": {}}', None) is None  # no name
    (call,) = parse_call(parser, '{"name": "f", "arguments": {"x": 1}}', None)
    assert call["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_eight_clients_mixing_chat_tool_and_plain_requests(tool_server):
    """The bounded loopback load test: 8 clients, 24 requests that share prefixes (a
    system prompt, the few-shot tool conversation, a completion's opening), chat,
    tool and plain completions, streamed or not, policies none and copy, all decoded
    in the same batches; every answer is the request's answer alone."""
    import concurrent.futures
    import time

    base, engine, client = tool_server
    system = {"role": "system", "content": "You answer in one short sentence."}
    cities = ["Paris", "London", "Rome"]
    plain = engine.pipe("none")

    def request(i: int) -> dict:
        kind = ("chat", "tool", "plain")[i % 3]
        policy = "copy" if i % 2 else "none"
        if kind == "chat":
            msgs = [system, {"role": "user", "content": f"Name {i} colours."}]
            return {"kind": kind, "policy": policy, "messages": msgs}
        if kind == "tool":
            return {"kind": kind, "policy": policy, "messages": _few_shot(cities[i % 3])}
        return {"kind": kind, "policy": policy, "prompt": f"Numbers: 1, 2, 3, 4, 5, {i},"}

    def one(i: int) -> tuple[dict, object, int, int]:
        r = request(i)
        extra = {"policy": r["policy"]}
        if r["kind"] == "plain":
            out = client.completions.create(
                model="tools", prompt=r["prompt"], max_tokens=12, extra_body=extra
            )
            return r, out.choices[0].text, out.usage.completion_tokens, 0
        kw = {"tools": TOOLS} if r["kind"] == "tool" else {}
        if i % 4 < 2:  # streamed
            chunks = list(
                client.chat.completions.create(
                    model="tools",
                    messages=r["messages"],
                    max_tokens=30,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=extra,
                    **kw,
                )
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [
                (tc.function.name, json.loads(tc.function.arguments))
                for c in chunks
                if c.choices
                for tc in c.choices[0].delta.tool_calls or []
            ]
            usage = chunks[-1].usage
        else:
            out = client.chat.completions.create(
                model="tools", messages=r["messages"], max_tokens=30, extra_body=extra, **kw
            )
            text = out.choices[0].message.content or ""
            calls = [
                (tc.function.name, json.loads(tc.function.arguments))
                for tc in out.choices[0].message.tool_calls or []
            ]
            usage = out.usage
        got = calls if r["kind"] == "tool" else text
        return r, got, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens

    engine.prefix.clear()
    n_req = 24
    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(n_req)))
    elapsed = time.perf_counter() - t
    for i, (r, got, _, _) in enumerate(results):
        if r["kind"] == "plain":
            want = plain.generate(engine.text_ids(r["prompt"]), max_tokens=12).text
        elif r["kind"] == "chat":
            want = plain.generate(engine.chat_ids(r["messages"]), max_tokens=30).text
        else:
            ids = engine.chat_ids(clean_messages(r["messages"]), TOOLS)
            raw = plain.generate(ids, max_tokens=30).text
            want = [("get_weather", {"city": cities[i % 3]})]
            assert json.dumps(want[0][1]) in raw  # the model's own call, decoded alone
        assert got == want, (i, r["kind"], r["policy"])
    assert sum(c for *_, c in results) > 0  # shared prefixes came from the prefix cache
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["queue_length"] == 0 and h["running"] == 0
    tokens = sum(n for _, _, n, _ in results)
    print(
        f"\nmixed load: {n_req} requests (chat, tool, plain) from 8 clients in {elapsed:.1f} s: "
        f"{n_req / elapsed:.2f} req/s, {tokens} tokens, {tokens / elapsed:.1f} tok/s aggregate"
    )
