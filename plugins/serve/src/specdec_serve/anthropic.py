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

Tools (``tools``, ``tool_choice``, ``tool_use`` / ``tool_result`` blocks), images,
documents, extended thinking and a final assistant message (prefilling the answer)
are refused with a 400, not ignored.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from .app import APIError, _generation_error, _number, _params, _specdec_object
from .engine import Job

if TYPE_CHECKING:  # pragma: no cover
    from .app import Server

#: Request fields that ask for tools or other things this server does not do yet:
#: refused when they are given and not empty.
UNSUPPORTED = ("tools", "tool_choice", "mcp_servers", "container")

#: Roles a message may have (a system prompt goes in the top-level ``system`` field).
ROLES = ("user", "assistant")

#: How the text blocks of one message's content are joined.
JOIN = "\n"


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    if status == 404:
        return "not_found_error"
    if status >= 500:
        return "api_error"
    return "invalid_request_error"


def error_body(exc: APIError) -> dict:
    """Anthropic's error object for a refusal the OpenAI routes would make."""
    return {"type": "error", "error": {"type": error_type(exc.status), "message": str(exc)}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _text(blocks: Any, where: str) -> str:
    """The text of ``content`` (a string or a list of content blocks); anything but
    text blocks is refused."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise APIError(f"{where} must be a string or a list of content blocks")
    parts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if not isinstance(kind, str):
            raise APIError(f"{where}[{j}] must be a content block with a type")
        if kind == "text":
            text = b.get("text")
            if not isinstance(text, str):
                raise APIError(f"{where}[{j}].text must be a string")
            parts.append(text)  # cache_control, citations: nothing to do here
        elif "tool" in kind:
            raise APIError(
                f"{where}[{j}] is a {kind!r} block: tools are not supported by this server yet"
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


def chat_messages(body: dict) -> list[dict]:
    """The ``{"role", "content"}`` messages of an Anthropic request, its ``system``
    prompt first (checked)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list")
    out = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "content" not in m:
            raise APIError(f"messages[{i}] must be an object with a role and content")
        role = m.get("role")
        if role not in ROLES:
            hint = (
                ": a system prompt goes in the top-level system field" if role == "system" else ""
            )
            raise APIError(f"messages[{i}].role must be 'user' or 'assistant', got {role!r}{hint}")
        out.append({"role": role, "content": _text(m["content"], f"messages[{i}].content")})
    if out[-1]["role"] == "assistant":
        raise APIError(
            "the last message is the assistant's: prefilling the answer is not supported "
            "by this server yet (end with a user message)"
        )
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


def stop_reason(finish: str | None, stop: str | None) -> str:
    """Anthropic's ``stop_reason`` for a finish reason and the stop string matched."""
    if finish == "length":
        return "max_tokens"
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
        msgs = chat_messages(body)
        policy = server._policy(body)
        ids = server._prompt({"messages": msgs}, True)
        params = _params(params, engine, len(ids))
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
            _events(server, job, mid, policy, len(ids)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _whole(server, job, mid, policy, len(ids), endpoint, request)


def _message(server: Server, mid: str, text: str | None, **fields: Any) -> dict:
    content = [] if text is None else [{"type": "text", "text": text}]
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
) -> JSONResponse:
    parts: list[str] = []
    n = 0
    stop = None
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():  # nobody to answer: stop the work
                    job.cancelled.set()
                    return JSONResponse({}, status_code=499)
                continue
            if item[0] == "token":
                r = item[1]
                parts.append(r.text)
                n += 0 if r.is_stop_token else 1
                if r.finish_reason is not None:
                    stop = r.stop_string
            elif item[0] == "done":
                stats, finish = item[1], item[2]
                break
            else:
                raise item[1]
    except asyncio.CancelledError:
        job.cancelled.set()
        raise
    except Exception as exc:
        err = _generation_error(exc)
        server.engine.metrics.request(endpoint, err.status)
        return error_response(err)
    server.engine.metrics.request(endpoint, 200)
    cached = int(stats.get("cached_tokens") or 0)
    body = _message(
        server,
        mid,
        "".join(parts),
        stop_reason=stop_reason(finish, stop),
        stop_sequence=stop,
        usage=usage(n_prompt, n, cached),
        specdec=_specdec_object(policy, stats),
    )
    return JSONResponse(body)


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(
    server: Server, job: Job, mid: str, policy: str, n_prompt: int
) -> AsyncIterator[str]:
    """Anthropic's stream: ``message_start``, ``content_block_start``, ``ping``, a
    ``content_block_delta`` per token with text, ``content_block_stop``,
    ``message_delta``, ``message_stop`` (an ``error`` event if generation fails)."""
    n = 0
    stop = None
    started = False
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
                    None,
                    stop_reason=None,
                    stop_sequence=None,
                    usage=usage(n_prompt, 0, job.cached),
                )
                yield _event("message_start", {"message": msg})
                block = {"type": "text", "text": ""}
                yield _event("content_block_start", {"index": 0, "content_block": block})
                yield _event("ping", {})
            if item[0] == "token":
                r = item[1]
                if r.finish_reason is not None:
                    stop = r.stop_string
                if not r.is_stop_token:
                    n += 1
                if not r.text:
                    continue
                delta = {"type": "text_delta", "text": r.text}
                fwd = r.stats.target_forwards if r.stats is not None else 0
                live = {
                    "from_draft": bool(r.from_draft),
                    "tokens_per_forward": round(n / fwd, 3) if fwd else None,
                }
                yield _event("content_block_delta", {"index": 0, "delta": delta, "specdec": live})
            else:  # done
                stats, finish = item[1], item[2]
                cached = int(stats.get("cached_tokens") or 0)
                yield _event("content_block_stop", {"index": 0})
                delta = {"stop_reason": stop_reason(finish, stop), "stop_sequence": stop}
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
