"""Anthropic's Messages API on ``specdec serve``: ``POST /v1/messages``.

A client that speaks Anthropic's protocol (the ``anthropic`` SDK, Claude Code style
agents) points its base URL at the server. The request is translated into what the
OpenAI routes check and run: the same prompt through the chat template
(``Server._prompt``), the same sampling checks (``_params``), the same policy and
pipeline checks (``Server._policy``, ``Server._pipe``), all before anything is
queued; the job runs as any other. Only the shapes differ: the response is an
Anthropic ``message``, a stream is Anthropic's server-sent events
(``message_start`` ... ``message_stop``), and an error is
``{"type": "error", "error": {"type", "message"}}``.

Tool use goes through the OpenAI route's machinery (:mod:`specdec_serve.tools`):
``tools`` become OpenAI function tools checked by ``check_tools`` and rendered by the
chat template, ``tool_use`` / ``tool_result`` blocks become an assistant's
``tool_calls`` and ``tool`` messages, and the calls the model writes are split out
with ``CallSplitter`` and parsed with mlx-lm's parser (``Server._released``) into
``tool_use`` blocks; ``tool_choice`` ``any`` and ``tool`` force a call (constrained
decoding, as the OpenAI route's ``required`` / a named function). Server tools, images,
documents, extended thinking and a final assistant message (prefilling the answer) are
refused with a 400, not ignored.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .app import APIError, _generation_error, _number, _params, _specdec_object, collect
from .engine import Job
from .tools import CallSplitter

if TYPE_CHECKING:  # pragma: no cover
    from .app import Server

#: Request fields that ask for things this server does not do: refused when they are
#: given and not empty.
UNSUPPORTED = ("mcp_servers", "container")

#: ``tool_choice`` types: ``auto``, ``none``, and ``any`` / ``tool`` (a call forced by
#: constrained decoding, as OpenAI's ``required`` / a named function).
TOOL_CHOICES = ("auto", "none", "any", "tool")

#: Roles a message may have (a system prompt goes in the top-level ``system`` field).
ROLES = ("user", "assistant")

#: How the text blocks of one message's content are joined.
JOIN = "\n"


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status == 404:
        return "not_found_error"
    if status == 413:
        return "request_too_large"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(exc: APIError) -> dict:
    """Anthropic's error object for a refusal the OpenAI routes would make."""
    return {"type": "error", "error": {"type": error_type(exc.status), "message": str(exc)}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _text(blocks: Any, where: str, skip: tuple[str, ...] = ()) -> str:
    """The text of ``content`` (a string or a list of content blocks): its text blocks
    joined; blocks of the types in ``skip`` are the caller's; anything else is refused."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(f"{where} must be a string or a list of content blocks")
    parts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(kind, str):
            raise APIError(f"{where}[{j}] must be a content block with a type")
        if kind in skip:
            continue
        if kind == "text":
            text = b.get("text")
            if not isinstance(text, str):
                raise APIError(f"{where}[{j}].text must be a string")
            parts.append(text)  # cache_control, citations: nothing to do here
        elif kind in ("tool_use", "tool_result"):
            owner = "an assistant" if kind == "tool_use" else "a user"
            raise APIError(f"{where}[{j}] is a {kind!r} block: those go in {owner} message")
        elif "tool" in kind:
            raise APIError(
                f"{where}[{j}] is a {kind!r} block: Anthropic's server tools are not "
                "supported by this server (client tools are)"
            )
        elif kind in ("image", "document", "search_result"):
            raise APIError(
                f"{where}[{j}] is a {kind!r} block: only text is supported by this server"
            )
        elif kind in ("thinking", "redacted_thinking"):
            raise APIError(
                f"{where}[{j}] is a {kind!r} block: extended thinking is not supported by this server"
            )
        else:
            raise APIError(f"{where}[{j}] has an unknown content block type {kind!r}")
    return JOIN.join(parts)


def _blocks(content: Any, kind: str) -> list[tuple[int, dict]]:
    """The ``kind`` blocks of a message's content, with their positions."""
    if not isinstance(content, list):
        return []
    return [(j, b) for j, b in enumerate(content) if isinstance(b, dict) and b.get("type") == kind]


def _tool_call(b: dict, where: str) -> dict:
    """An assistant's ``tool_use`` block as an OpenAI ``tool_calls`` entry (its
    ``input`` object as the arguments, as chat templates take them)."""
    for k in ("id", "name"):
        if not isinstance(b.get(k), str) or not b[k]:
            raise APIError(f"{where}.{k} must be a non-empty string")
    if not isinstance(b.get("input"), dict):
        raise APIError(f"{where}.input must be an object, got {b.get('input')!r:.100}")
    fn = {"name": b["name"], "arguments": b["input"]}
    return {"id": b["id"], "type": "function", "function": fn}


def _tool_message(b: dict, where: str, names: dict[str, str]) -> dict:
    """A user's ``tool_result`` block as an OpenAI ``tool`` message; ``names``: the
    tool of each earlier ``tool_use`` id. ``is_error`` puts ``Error: `` before the
    result (chat templates have no field for it)."""
    use = b.get("tool_use_id")
    if not isinstance(use, str) or not use:
        raise APIError(f"{where}.tool_use_id must be a non-empty string")
    if use not in names:
        raise APIError(
            f"{where}.tool_use_id {use!r} answers no tool_use block of an earlier assistant message"
        )
    content = b.get("content")
    text = "" if content is None else _text(content, f"{where}.content")
    is_error = b.get("is_error")
    if is_error not in (None, True, False):
        raise APIError(f"{where}.is_error must be true or false, got {is_error!r:.100}")
    if is_error:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": use, "name": names[use], "content": text}


def chat_messages(body: dict) -> list[dict]:
    """The OpenAI-style chat messages of an Anthropic request (checked): its ``system``
    prompt first; an assistant's ``tool_use`` blocks as its ``tool_calls``; a user's
    ``tool_result`` blocks as ``tool`` messages, in order, then its text as a user
    message (when it has text or no results)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list")
    out: list[dict] = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    names: dict[str, str] = {}  # tool_use id -> its tool's name
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "content" not in m:
            raise APIError(f"messages[{i}] must be an object with a role and content")
        role = m.get("role")
        if role not in ROLES:
            hint = (
                ": a system prompt goes in the top-level system field" if role == "system" else ""
            )
            raise APIError(f"messages[{i}].role must be 'user' or 'assistant', got {role!r}{hint}")
        where = f"messages[{i}].content"
        content = m["content"]
        if role == "assistant":
            text = _text(content, where, skip=("tool_use",))
            calls = [_tool_call(b, f"{where}[{j}]") for j, b in _blocks(content, "tool_use")]
            for c in calls:
                names[c["id"]] = c["function"]["name"]
            msg: dict = {"role": role, "content": text}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        text = _text(content, where, skip=("tool_result",))
        results = [
            _tool_message(b, f"{where}[{j}]", names) for j, b in _blocks(content, "tool_result")
        ]
        out += results
        if text or not results:
            out.append({"role": role, "content": text})
    if messages[-1].get("role") == "assistant":
        raise APIError(
            "the last message is the assistant's: prefilling the answer is not supported "
            "by this server yet (end with a user message)"
        )
    return out


def tool_request(body: dict) -> dict:
    """The request's ``tools`` and ``tool_choice`` as the OpenAI route's fields
    (``{"tools", "tool_choice"}``, for ``check_tools``), their Anthropic shapes checked:
    client tools ``{name, description, input_schema}`` as function tools,
    ``{"type": "auto" | "none" | "any"}`` as ``"auto"`` / ``"none"`` / ``"required"``,
    ``{"type": "tool", "name"}`` as a named function (one naming none of the request's
    tools says which it has); refused: server tools and ``disable_parallel_tool_use: true`` (nothing here limits
    the model to one call)."""
    tools = body.get("tools")
    out: dict[str, Any] = {}
    names: list[str] = []
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise APIError("tools must be a list of {name, description, input_schema}")
        out["tools"] = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict):
                raise APIError(f"tools[{i}] must be an object {{name, description, input_schema}}")
            if t.get("type") not in (None, "custom"):
                raise APIError(
                    f"tools[{i}] is Anthropic's server tool {t.get('type')!r:.100}: server tools "
                    "are not supported by this server (client tools are: name, description, "
                    "input_schema)"
                )
            name, schema, desc = t.get("name"), t.get("input_schema"), t.get("description")
            if not isinstance(name, str) or not name:
                raise APIError(f"tools[{i}].name must be a non-empty string")
            if not isinstance(schema, dict):
                raise APIError(
                    f"tools[{i}].input_schema must be a JSON schema object, got {schema!r:.100}"
                )
            if desc is not None and not isinstance(desc, str):
                raise APIError(f"tools[{i}].description must be a string")
            fn = {"name": name, **({} if desc is None else {"description": desc})}
            out["tools"].append({"type": "function", "function": {**fn, "parameters": schema}})
            names.append(name)
    choice = body.get("tool_choice")
    if choice is None:
        return out
    if not isinstance(choice, dict) or choice.get("type") not in TOOL_CHOICES:
        raise APIError(
            'tool_choice must be {"type": "auto"}, {"type": "none"}, {"type": "any"} or '
            f'{{"type": "tool", "name": ...}}, got {choice!r:.200}'
        )
    kind = choice["type"]
    parallel = choice.get("disable_parallel_tool_use")
    if parallel not in (None, False):
        raise APIError(
            "tool_choice.disable_parallel_tool_use: true is not supported: nothing here "
            "limits the model to one call (send false or leave it out)"
            if parallel is True
            else f"tool_choice.disable_parallel_tool_use must be true or false, got {parallel!r:.100}"
        )
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise APIError('tool_choice {"type": "tool"} needs the name of a tool')
        if name not in names:
            have = f"the request's tools are {', '.join(names)}" if names else "it has no tools"
            raise APIError(f"tool_choice names tool {name!r}; {have}")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
        return out
    out["tool_choice"] = "required" if kind == "any" else kind
    return out


def sampling(body: dict) -> dict:
    """The fields of an Anthropic request that ``_params`` reads, under its names
    (checked where Anthropic's rules differ from OpenAI's)."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, [], {}):
            raise APIError(f"{name} is not supported by this server yet")
    thinking = body.get("thinking")
    if thinking is not None and not (
        isinstance(thinking, dict) and thinking.get("type") == "disabled"
    ):
        raise APIError("thinking (extended thinking) is not supported by this server")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise APIError("max_tokens: field required")
    out: dict[str, Any] = {"max_tokens": max_tokens}
    # Anthropic's temperature is in [0, 1]; the default here is 0 (greedy), as on the
    # OpenAI routes, not Anthropic's 1
    out["temperature"] = _number(body, "temperature", 0.0, low=0.0, high=1.0)
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    stop = body.get("stop_sequences")
    if stop is not None:
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > 16
        ):
            raise APIError("stop_sequences must be a list of up to 16 non-empty strings")
        out["stop"] = stop or None
    return out


def stop_reason(finish: str | None, stop: str | None, calls: bool = False) -> str:
    """Anthropic's ``stop_reason`` for a finish reason and the stop string matched;
    ``calls``: the answer made tool calls (``tool_use`` when it then stopped)."""
    if finish == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"


def usage(n_prompt: int, n_out: int, cached: int) -> dict:
    """Anthropic's usage object: ``input_tokens`` are the prompt's tokens prefilled,
    ``cache_read_input_tokens`` those taken from the prefix cache (their sum is the
    prompt's length); nothing is written to a cache on request."""
    return {
        "input_tokens": n_prompt - cached,
        "output_tokens": n_out,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


async def messages(server: Server, request: Request) -> Any:
    """``POST /v1/messages``."""
    endpoint = request.url.path
    engine = server.engine
    try:
        body = await server._body(request)  # JSON, and the served model's id
        if not isinstance(body.get("model"), str):
            raise APIError("model: field required (the served model's id)")
        params = sampling(body)
        tools, forced = server._tools(tool_request(body), True)  # as a chat request's
        msgs = chat_messages(body)
        if any(m["role"] == "tool" or m.get("tool_calls") for m in msgs) and not getattr(
            engine.tokenizer, "has_tool_calling", False
        ):
            raise APIError(
                f"{engine.model_name}'s chat template has no tool-call format (mlx-lm finds "
                "none in it), so it cannot render tool_use / tool_result blocks"
            )
        policy = server._policy(body)
        ids = server._prompt({"messages": msgs}, True, tools)
        params = _params(params, engine, len(ids), grammar=forced)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise APIError(f"stream must be true or false, got {stream!r}")
        server._pipe(policy, params)  # the policy assembles, and takes these arguments
    except APIError as exc:
        engine.metrics.request(endpoint, exc.status)
        return error_response(exc)
    job = Job(policy, ids, params, asyncio.get_running_loop())
    engine.submit(job)
    mid = "msg_" + uuid.uuid4().hex[:24]
    if stream:
        engine.metrics.request(endpoint, 200)
        return StreamingResponse(
            _events(server, job, mid, policy, len(ids), tools),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(server, job, mid, policy, len(ids), endpoint, request, tools)


class Blocks:
    """An answer's content blocks as its text arrives, as the stream's block events
    (``(type, data)``: ``content_block_start`` / ``_delta`` / ``_stop``) that also build
    the whole message's ``content``, so both give the same blocks.

    Without tools: one text block, opened at once. With tools: the text goes through
    a :class:`CallSplitter` at the template's call markers (text inside a call held
    back); each call the parser reads (``Server._released``) into an object becomes a
    ``tool_use`` block (one ``input_json_delta`` with its arguments' JSON), after the
    open text block is closed; a call it cannot read stays text. A text block opens at
    its first non-whitespace character: whitespace around calls is dropped, except
    that an answer with no block at all gets one text block.
    """

    def __init__(self, server: Server, tools: list[dict] | None) -> None:
        self.server, self.tools = server, tools
        self.splitter: CallSplitter | None = server._splitter() if tools is not None else None
        self.content: list[dict] = []
        self.open = False  # the last block is a text block still growing
        self.pending = ""  # whitespace not in a block yet
        self.calls = 0

    def start(self) -> list[tuple[str, dict]]:
        """The events before any text: without tools the text block opens at once."""
        return self._open() if self.splitter is None else []

    def feed(self, text: str) -> list[tuple[str, dict]]:
        if self.splitter is None:
            return self._text(text)
        return [e for kind, s in self.splitter.feed(text) for e in self._item(kind, s)]

    def finish(self) -> list[tuple[str, dict]]:
        """The events at the end: held-back text, and the last block's stop."""
        out = []
        if self.splitter is not None:
            out = [e for kind, s in self.splitter.finish() for e in self._item(kind, s)]
        if not self.content:  # no block at all: the answer's one text block, maybe empty
            out += self._open() + self._text(self.pending)
        out += self._close()
        return out

    def _open(self) -> list[tuple[str, dict]]:
        self.content.append({"type": "text", "text": ""})
        self.open = True
        block = {"type": "text", "text": ""}
        return [("content_block_start", {"index": len(self.content) - 1, "content_block": block})]

    def _close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        return [("content_block_stop", {"index": len(self.content) - 1})]

    def _text(self, s: str) -> list[tuple[str, dict]]:
        if not self.open:
            self.pending += s
            if not self.pending.strip():
                return []
            s, self.pending = self.pending, ""
            out = self._open()
        else:
            out = []
        if s:
            self.content[-1]["text"] += s
            delta = {"type": "text_delta", "text": s}
            out.append(("content_block_delta", {"index": len(self.content) - 1, "delta": delta}))
        return out

    def _item(self, kind: str, s: str) -> list[tuple[str, dict]]:
        """A splitter's ``("text", s)`` or ``("call", raw)``."""
        text, calls = self.server._released([(kind, s)], self.tools)
        inputs = []
        for c in calls:
            try:
                inputs.append(json.loads(c["function"]["arguments"]))
            except json.JSONDecodeError:
                inputs.append(None)
        if not calls or not all(isinstance(x, dict) for x in inputs):
            if calls:  # read, but its arguments are no object: the text the model wrote
                tok = self.server.engine.tokenizer
                text = tok.tool_call_start + s + tok.tool_call_end
            return self._text(text)
        out = self._close()
        self.pending = ""  # whitespace before a call
        for c, args in zip(calls, inputs):
            self.calls += 1
            i = len(self.content)
            tid = "toolu_" + uuid.uuid4().hex[:24]
            name = c["function"]["name"]
            self.content.append({"type": "tool_use", "id": tid, "name": name, "input": args})
            block = {"type": "tool_use", "id": tid, "name": name, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": c["function"]["arguments"]}
            out += [
                ("content_block_start", {"index": i, "content_block": block}),
                ("content_block_delta", {"index": i, "delta": delta}),
                ("content_block_stop", {"index": i}),
            ]
        return out


def _message(server: Server, mid: str, content: list[dict], **fields: Any) -> dict:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": server.engine.model_name,
        "content": content,
        **fields,
    }


async def _whole(
    server: Server,
    job: Job,
    mid: str,
    policy: str,
    n_prompt: int,
    endpoint: str,
    request: Request,
    tools: list[dict] | None = None,
) -> JSONResponse:
    try:
        done = await collect(job, request)
    except Exception as exc:
        err = _generation_error(exc)
        server.engine.metrics.request(endpoint, err.status)
        return error_response(err)
    if done is None:
        return JSONResponse({}, status_code=499)
    server.engine.metrics.request(endpoint, 200)
    stats, finish, stop, n = done.stats, done.finish, done.stop_string, len(done.emitted)
    cached = int(stats.get("cached_tokens") or 0)
    blocks = Blocks(server, tools)
    blocks.start()
    blocks.feed(done.text)
    blocks.finish()
    body = _message(
        server,
        mid,
        blocks.content,
        stop_reason=stop_reason(finish, stop, blocks.calls > 0),
        stop_sequence=stop,
        usage=usage(n_prompt, n, cached),
        specdec=_specdec_object(policy, stats),
    )
    return JSONResponse(body)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(
    server: Server,
    job: Job,
    mid: str,
    policy: str,
    n_prompt: int,
    tools: list[dict] | None = None,
) -> AsyncIterator[str]:
    """Anthropic's stream: ``message_start``, the blocks' events (:class:`Blocks`:
    without tools ``content_block_start`` of the text block before the ``ping``, a
    ``content_block_delta`` per token with text, ``content_block_stop``; with tools
    also a ``tool_use`` block per call), ``message_delta``, ``message_stop`` (an
    ``error`` event if generation fails)."""
    n = 0
    stop = None
    started = False
    blocks = Blocks(server, tools)
    try:
        while True:
            item = await job.out.get()
            if item[0] == "error":
                yield _event("error", error_body(_generation_error(item[1])))
                return
            if not started:  # the prompt is in: how much of it came from the prefix cache
                started = True
                msg = _message(
                    server,
                    mid,
                    [],
                    stop_reason=None,
                    stop_sequence=None,
                    usage=usage(n_prompt, 0, job.cached),
                )
                yield _event("message_start", {"message": msg})
                for kind, data in blocks.start():
                    yield _event(kind, data)
                yield _event("ping", {})
            if item[0] == "token":
                r = item[1]
                if r.finish_reason is not None:
                    stop = r.stop_string
                if not r.is_stop_token:
                    n += 1
                if not r.text:
                    continue
                fwd = r.stats.target_forwards if r.stats is not None else 0
                live = {
                    "from_draft": bool(r.from_draft),
                    "tokens_per_forward": round(n / fwd, 3) if fwd else None,
                }
                for kind, data in blocks.feed(r.text):
                    if data.get("delta", {}).get("type") == "text_delta":
                        data = {**data, "specdec": live}
                    yield _event(kind, data)
            else:  # done
                stats, finish = item[1], item[2]
                cached = int(stats.get("cached_tokens") or 0)
                for kind, data in blocks.finish():
                    yield _event(kind, data)
                delta = {
                    "stop_reason": stop_reason(finish, stop, blocks.calls > 0),
                    "stop_sequence": stop,
                }
                yield _event(
                    "message_delta",
                    {
                        "delta": delta,
                        "usage": usage(n_prompt, n, cached),
                        "specdec": _specdec_object(policy, stats),
                    },
                )
                yield _event("message_stop", {})
                return
    finally:
        job.cancelled.set()  # a client that went away: its row leaves at the next round
