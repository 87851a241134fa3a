"""Tool use on the Anthropic Messages API (``POST /v1/messages``) against the official
anthropic client: tools through the chat template, calls returned and streamed as
tool_use blocks; refusals before any model work."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from anthropic.types import Message
from specdec_serve.anthropic import Blocks, chat_messages
from specdec_serve.app import Server
from specdec_serve.tools import clean_messages

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}]
#: the same tool as the OpenAI route takes it
OAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": SCHEMA,
        },
    }
]
#: four earlier turns: after three, the 135M model copies a <tool_response> instead of a call
CITIES = ["Paris", "London", "Rome", "Madrid"]


def _few_shot(city: str, say: str | None = None) -> list[dict]:
    """Earlier turns where the assistant answered with a call (after ``say``, if given)
    and the user sent its result with the next question: the model copies the frame."""
    msgs: list[dict] = []
    results: list[dict] = []
    for i, c in enumerate(CITIES):
        question = {"type": "text", "text": f"What is the weather in {c}?"}
        msgs.append(
            {"role": "user", "content": [*results, question] if results else question["text"]}
        )
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": c}}
        text = [{"type": "text", "text": say}] if say else []
        msgs.append({"role": "assistant", "content": [*text, use]})
        results = [{"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"sunny in {c}"}]
    question = {"type": "text", "text": f"What is the weather in {city}?"}
    return msgs + [{"role": "user", "content": [*results, question]}]


def _few_shot_openai(city: str, say: str | None = None) -> list[dict]:
    """:func:`_few_shot` as the OpenAI route's messages (what the translation gives)."""
    msgs: list[dict] = []
    for i, c in enumerate(CITIES):
        call = {
            "id": f"toolu_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": c}},
        }
        msgs += [
            {"role": "user", "content": f"What is the weather in {c}?"},
            {"role": "assistant", "content": say or "", "tool_calls": [call]},
            {
                "role": "tool",
                "tool_call_id": f"toolu_{i}",
                "name": "get_weather",
                "content": f"sunny in {c}",
            },
        ]
    return msgs + [{"role": "user", "content": f"What is the weather in {city}?"}]


@pytest.fixture(scope="module")
def ant(tool_server):
    return anthropic.Anthropic(base_url=tool_server[0], api_key="unused", max_retries=0)


def _prompt_len(m: Message) -> int:
    return m.usage.input_tokens + m.usage.cache_read_input_tokens


def _still_serving(ant, model):
    m = ant.messages.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}], tools=TOOLS
    )
    assert m.type == "message" and m.usage.output_tokens >= 1


def test_the_few_shot_translates_to_the_openai_messages():
    assert chat_messages({"messages": _few_shot("Oslo")}) == _few_shot_openai("Oslo")
    say = "Let me check."
    assert chat_messages({"messages": _few_shot("Oslo", say)}) == _few_shot_openai("Oslo", say)


@pytest.mark.parametrize("policy", ["none", "copy"])
def test_a_tool_use_block_is_returned(tool_server, ant, policy):
    _, engine, _ = tool_server
    m = ant.messages.create(
        model="tools",
        max_tokens=40,
        messages=_few_shot("Paris"),
        tools=TOOLS,
        extra_body={"policy": policy},
    )
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    (block,) = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}
    # the prompt: the translated conversation and the tools through the template
    ids = engine.chat_ids(clean_messages(_few_shot_openai("Paris")), OAI_TOOLS)
    assert _prompt_len(m) == len(ids)
    text = engine.tokenizer.decode(ids)
    assert "<tool_response>\nsunny in Rome\n</tool_response>" in text
    assert '{"name": "get_weather", "arguments": {"city": "London"}}' in text
    assert '"name": "get_weather", "description": "The weather in a city"' in text  # the tool
    # what the model wrote: the template's frame, decoded by the plain pipeline too
    raw = engine.pipe("none").generate(ids, max_tokens=40).text
    assert raw.startswith("<tool_call>") and raw.rstrip().endswith("</tool_call>")
    sd = m.model_extra["specdec"]
    assert sd["policy"] == policy
    if policy == "copy":
        assert sd["accepted"] > 0


def test_streaming_gives_the_same_message(tool_server, ant):
    kw = dict(
        model="tools",
        max_tokens=60,
        messages=_few_shot("London", "Let me check."),
        tools=TOOLS,
        extra_body={"policy": "copy"},
    )
    whole = ant.messages.create(**kw)
    with ant.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()

    def shape(m):
        return [b.model_dump(exclude={"id"}) for b in m.content]

    assert shape(final) == shape(whole)
    assert [b.type for b in whole.content] == ["text", "tool_use"]
    assert whole.content[0].text.startswith("Let me check.")
    assert text == whole.content[0].text and "<tool_call>" not in text
    assert whole.content[1].input == {"city": "London"}
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert _prompt_len(final) == _prompt_len(whole)


def _events(base: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", base + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    for frame in raw.split("\n\n"):
        if not frame:
            continue
        kind, data = frame.split("\n")
        payload = json.loads(data[len("data: ") :])
        assert kind == "event: " + payload["type"]
        events.append(payload)
    return events


def test_tool_use_events_on_the_wire(tool_server):
    base, _, _ = tool_server
    body = {
        "model": "tools",
        "max_tokens": 60,
        "stream": True,
        "messages": _few_shot("Rome", "Let me check."),
        "tools": TOOLS,
        "policy": "copy",
    }
    events = _events(base, body)
    kinds = [e["type"] for e in events]
    n_text = kinds.count("content_block_delta") - 1  # one delta is the call's
    assert kinds == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * n_text,
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert n_text >= 1
    assert events[2] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    texts = events[3 : 3 + n_text]
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in texts)
    assert all("from_draft" in e["specdec"] for e in texts)
    assert "".join(e["delta"]["text"] for e in texts).startswith("Let me check.")
    assert "<tool" not in "".join(e["delta"]["text"] for e in texts)  # held back
    stop, start, delta, stop2 = events[3 + n_text : 7 + n_text]
    assert stop == {"type": "content_block_stop", "index": 0}
    block = start["content_block"]
    assert start["index"] == 1 and block["type"] == "tool_use" and block["input"] == {}
    assert block["id"].startswith("toolu_") and block["name"] == "get_weather"
    assert delta["index"] == 1 and delta["delta"]["type"] == "input_json_delta"
    assert json.loads(delta["delta"]["partial_json"]) == {"city": "Rome"}
    assert stop2 == {"type": "content_block_stop", "index": 1}
    end = events[-2]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["specdec"]["policy"] == "copy"


def test_an_answer_that_is_only_a_call_streams_one_block(tool_server):
    base, _, _ = tool_server
    body = {
        "model": "tools",
        "max_tokens": 40,
        "stream": True,
        "messages": _few_shot("Paris"),
        "tools": TOOLS,
    }
    events = _events(base, body)
    assert [e["type"] for e in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[2]["index"] == 0 and events[2]["content_block"]["type"] == "tool_use"
    assert json.loads(events[3]["delta"]["partial_json"]) == {"city": "Paris"}
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_blocks_are_the_same_fed_whole_or_by_character(tool_server):
    _, engine, _ = tool_server
    server = Server(engine)
    text = (
        "\nSure.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>\n'
        "<tool_call>\n{not json\n</tool_call> done <tool"
    )
    whole = Blocks(server, OAI_TOOLS)
    whole_events = whole.start() + whole.feed(text) + whole.finish()
    each = Blocks(server, OAI_TOOLS)
    each_events = each.start() + [e for ch in text for e in each.feed(ch)] + each.finish()

    def no_ids(blocks):
        return [{k: v for k, v in b.items() if k != "id"} for b in blocks]

    assert (
        no_ids(whole.content)
        == no_ids(each.content)
        == [
            {"type": "text", "text": "\nSure.\n"},
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Bergen"}},
            # the call the parser cannot read stays as the text the model wrote
            {"type": "text", "text": "\n<tool_call>\n{not json\n</tool_call> done <tool"},
        ]
    )
    assert whole.calls == each.calls == 2
    for events in (whole_events, each_events):
        starts = [e[1]["index"] for e in events if e[0] == "content_block_start"]
        stops = [e[1]["index"] for e in events if e[0] == "content_block_stop"]
        assert starts == stops == [0, 1, 2, 3]
        texts = "".join(
            e[1]["delta"]["text"]
            for e in events
            if e[1].get("delta", {}).get("type") == "text_delta"
        )
        assert texts == "\nSure.\n" + "\n<tool_call>\n{not json\n</tool_call> done <tool"
    # whitespace between calls is no block; no tools: one text block, also when empty
    b = Blocks(server, OAI_TOOLS)
    b.feed('<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>\n\n')
    b.finish()
    assert [x["type"] for x in b.content] == ["tool_use"]
    b = Blocks(server, OAI_TOOLS)
    b.feed("  ")
    b.finish()
    assert b.content == [{"type": "text", "text": "  "}] and b.calls == 0
    b = Blocks(server, None)
    assert b.start()[0][0] == "content_block_start"
    b.feed("<tool_call>x</tool_call>")
    b.finish()
    assert b.content == [{"type": "text", "text": "<tool_call>x</tool_call>"}]


def test_tool_results_render_into_the_prompt(tool_server, ant):
    _, engine, _ = tool_server
    conv = [
        {"role": "user", "content": "What is the weather in Paris and in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking both."},
                {"type": "tool_use", "id": "a", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "b", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "a",
                    "content": [{"type": "text", "text": "sunny, 21 C"}],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "b",
                    "content": "no such city",
                    "is_error": True,
                },
                {"type": "text", "text": "And now?"},
            ],
        },
    ]
    expected = [
        {"role": "user", "content": "What is the weather in Paris and in Oslo?"},
        {
            "role": "assistant",
            "content": "Checking both.",
            "tool_calls": [
                {
                    "id": "a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "a", "name": "get_weather", "content": "sunny, 21 C"},
        {
            "role": "tool",
            "tool_call_id": "b",
            "name": "get_weather",
            "content": "Error: no such city",
        },
        {"role": "user", "content": "And now?"},
    ]
    assert chat_messages({"messages": conv}) == expected
    m = ant.messages.create(model="tools", max_tokens=4, messages=conv, tools=TOOLS)
    ids = engine.chat_ids(clean_messages(expected), OAI_TOOLS)
    assert _prompt_len(m) == len(ids)
    text = engine.tokenizer.decode(ids)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert "<tool_response>\nError: no such city\n</tool_response>" in text
    assert (
        'Checking both.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '\n</tool_call><tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    )
    assert text.index("Error: no such city") < text.index("And now?")
    # only results in the last user message: no empty user message after them
    only = conv[:2] + [{"role": "user", "content": conv[2]["content"][:2]}]
    assert chat_messages({"messages": only}) == expected[:4]
    m = ant.messages.create(model="tools", max_tokens=4, messages=only, tools=TOOLS)
    assert _prompt_len(m) == len(engine.chat_ids(clean_messages(expected[:4]), OAI_TOOLS))


def test_tool_choice_auto_and_none(tool_server, ant):
    msgs = [{"role": "user", "content": "Say hi."}]
    kw = dict(model="tools", max_tokens=4, messages=msgs)
    plain = ant.messages.create(**kw)
    auto = ant.messages.create(**kw, tools=TOOLS)
    auto2 = ant.messages.create(**kw, tools=TOOLS, tool_choice={"type": "auto"})
    auto3 = ant.messages.create(
        **kw, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": False}
    )
    none = ant.messages.create(**kw, tools=TOOLS, tool_choice={"type": "none"})
    assert _prompt_len(none) == _prompt_len(plain)  # the tools are not rendered
    assert _prompt_len(auto) == _prompt_len(auto2) == _prompt_len(auto3) > _prompt_len(plain)
    for m in (plain, auto, none):  # a text answer: one text block, as without tools
        assert [b.type for b in m.content] == ["text"] and m.stop_reason != "tool_use"
    assert auto.content[0].text == auto2.content[0].text


@pytest.mark.parametrize(
    "change, needle",
    [
        (
            {"tool_choice": {"type": "tool", "name": "nope"}},
            "tool_choice names tool 'nope'; the request's tools are get_weather",
        ),
        ({"tool_choice": {"type": "required"}}, "tool_choice must be"),
        ({"tool_choice": "auto"}, "tool_choice must be"),
        (
            {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
            "disable_parallel_tool_use: true is not supported",
        ),
        (
            {"tools": [{"name": "get_weather"}]},
            "tools[0].input_schema must be a JSON schema object",
        ),
        (
            {"tools": [{"name": "get_weather", "input_schema": "object"}]},
            "tools[0].input_schema must be",
        ),
        ({"tools": [{"input_schema": SCHEMA}]}, "tools[0].name must be a non-empty string"),
        ({"tools": TOOLS + TOOLS}, "two tools are named 'get_weather'"),
        ({"tools": {"name": "get_weather"}}, "tools must be a list"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "server tool 'web_search_20250305'",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "x"}],
                    },
                ]
            },
            "tool_use_id 't2' answers no tool_use block",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": "x"}
                        ],
                    },
                    {"role": "user", "content": "and?"},
                ]
            },
            "messages[1].content[0].input must be an object",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                    }
                ]
            },
            "those go in an assistant message",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [
                                    {
                                        "type": "image",
                                        "source": {
                                            "type": "base64",
                                            "media_type": "image/png",
                                            "data": "",
                                        },
                                    }
                                ],
                            }
                        ],
                    },
                ]
            },
            "only text is supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "server_tool_use",
                                "id": "s",
                                "name": "web_search",
                                "input": {},
                            }
                        ],
                    }
                ]
            },
            "server tools are not supported",
        ),
    ],
)
def test_bad_tool_requests_get_anthropic_errors(tool_server, ant, monkeypatch, change, needle):
    _, engine, _ = tool_server
    queued = []
    monkeypatch.setattr(engine, "submit", queued.append)  # nothing may be queued
    body = {
        "model": "tools",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        **change,
    }
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.post("/v1/messages", cast_to=Message, body=body)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert needle in e.value.body["error"]["message"], e.value.body
    assert queued == []  # refused before anything was queued
    monkeypatch.undo()
    _still_serving(ant, "tools")


def test_a_template_without_a_tool_format(server):
    """The default model's template has no tool-call format: tools and tool blocks are
    400s; tool_choice none (nothing rendered) and auto without tools are served."""
    base, engine = server
    ant = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    kw = dict(model=engine.model_name, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(**kw, tools=TOOLS)
    assert "has no tool-call format" in e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == "invalid_request_error"
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}],
        },
    ]
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(**{**kw, "messages": history})
    assert "cannot render tool_use / tool_result blocks" in e.value.body["error"]["message"]
    plain = ant.messages.create(**kw)
    none = ant.messages.create(**kw, tools=TOOLS, tool_choice={"type": "none"})
    auto = ant.messages.create(**kw, tool_choice={"type": "auto"})
    assert none.content[0].text == auto.content[0].text == plain.content[0].text
    assert _prompt_len(none) == _prompt_len(plain)
