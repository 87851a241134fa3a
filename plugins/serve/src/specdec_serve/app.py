"""The HTTP side of ``specdec serve``: an OpenAI-compatible API on Starlette.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming with
server-sent events, or one JSON response), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text) and ``GET /`` (a page to try the model); and
Anthropic's ``POST /v1/messages`` (:mod:`specdec_serve.anthropic`).

Every request is checked before it is queued; a bad one gets an OpenAI-style
error (``{"error": {"message", "type", "param", "code"}}``) with a 4xx status and
the server goes on serving.
"""

from __future__ import annotations

import asyncio
import html
import json
import math
import time
import uuid
from importlib import resources
from typing import Any

import attrs
import specdec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from .engine import Engine, Job
from .tools import (
    CallSplitter,
    ToolError,
    call_grammar,
    check_tools,
    clean_messages,
    parse_call,
)

#: Request fields that ask for something this server does not do: refused, not ignored.
UNSUPPORTED = (
    "echo",
    "best_of",
    "suffix",
)


class APIError(Exception):
    """A request the server refuses: an OpenAI-style error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_

    def body(self) -> dict:
        """The OpenAI-style error object."""
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _number(
    body: dict, name: str, default: float, *, low: float, high: float | None = None
) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise APIError(
            f"{name} must be a finite number, got {v!r}", param=name, code="invalid_type"
        )
    if v < low or (high is not None and v > high):
        rng = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
        raise APIError(f"{name} must be {rng}, got {v!r}", param=name, code="invalid_value")
    return float(v)


#: alternatives per token at most (``top_logprobs``; OpenAI's bound)
MAX_TOP_LOGPROBS = 20


def _logprobs(body: dict, chat: bool) -> int | None:
    """The request's ``logprobs`` (``Request.logprobs``): chat's ``logprobs: true`` with
    ``top_logprobs`` alternatives, or completions' ``logprobs: n``; ``None``: off."""
    lp = body.get("logprobs")
    top = body.get("top_logprobs")
    if chat:
        if lp not in (None, True, False):
            raise APIError(
                f"logprobs must be true or false, got {lp!r}", param="logprobs", code="invalid_type"
            )
        if top is not None and not lp:
            raise APIError(
                "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
            )
        name, n = "top_logprobs", (top if top is not None else 0) if lp else None
    else:
        if top is not None:
            raise APIError(
                "top_logprobs is a chat field; completions take logprobs: n",
                param="top_logprobs",
                code="invalid_value",
            )
        name, n = "logprobs", lp
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(
            f"{name} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}",
            param=name,
            code="invalid_value",
        )
    return n


def output_grammar(body: dict) -> dict | None:
    """The request ``grammar`` that ``response_format`` or ``grammar`` asks for (``None``:
    free text): ``{"type": "json_object"}`` (any JSON object), ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``, ``{"type": "text"}``; or this
    server's ``grammar`` field, ``{"regex": pattern}`` or ``{"lark": grammar}``
    (llguidance's syntax; a ``{"json_schema": schema}`` too).

    Raises:
        APIError: another shape, or both fields.
    """
    rf, grammar = body.get("response_format"), body.get("grammar")
    if rf is not None and grammar is not None:
        raise APIError(
            "send response_format or grammar, not both", param="grammar", code="invalid_value"
        )
    if grammar is not None:
        return grammar  # its shape is checked by specdec.Request (a 400 naming it)
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": '
                f"{{...}}}}}}, got {js!r:.200}",
                param="response_format",
                code="invalid_value",
            )
        return {"json_schema": schema}
    raise APIError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or '
        f'{{"type": "json_schema", "json_schema": {{...}}}}, got {rf!r:.200}',
        param="response_format",
        code="invalid_value",
    )


def _params(
    body: dict, engine: Engine, prompt_len: int, *, chat: bool = True, grammar: dict | None = None
) -> dict:
    """``Pipeline.stream`` keyword arguments from the request body (checked); ``grammar``
    (a forced tool call's) or the body's ``response_format`` / ``grammar``."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = 256
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise APIError(
            f"max_tokens must be an integer >= 1, got {max_tokens!r}",
            param="max_tokens",
            code="invalid_value",
        )
    ctx = engine.context_length
    if ctx is not None and prompt_len >= ctx:
        raise APIError(
            f"the prompt is {prompt_len} tokens; this model's context is {ctx} tokens",
            param="messages" if "messages" in body else "prompt",
            code="context_length_exceeded",
        )
    if ctx is not None:
        max_tokens = min(max_tokens, ctx - prompt_len)
    n = body.get("n", 1)
    if n not in (1, None):
        raise APIError(
            f"n must be 1 (one choice per request), got {n!r}", param="n", code="invalid_value"
        )
    temperature = _number(body, "temperature", 0.0, low=0.0)
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise APIError("top_p must be > 0", param="top_p", code="invalid_value")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise APIError(f"seed must be an integer, got {seed!r}", param="seed", code="invalid_type")
    for name in UNSUPPORTED:
        v = body.get(name)
        if v not in (None, False, 0, [], {}) and not (name == "best_of" and v == 1):
            raise APIError(
                f"{name} is not supported by this server", param=name, code="unsupported"
            )
    penalties: dict[str, Any] = {}
    top_k = body.get("top_k", 0)
    if top_k not in (None, 0, -1):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise APIError(
                f"top_k must be an integer >= 0 (0 or -1: off), got {top_k!r}",
                param="top_k",
                code="invalid_value",
            )
        penalties["top_k"] = top_k
    min_p = _number(body, "min_p", 0.0, low=0.0, high=1.0)
    if min_p:
        penalties["min_p"] = min_p
    rep = body.get("repetition_penalty")
    if rep not in (None, 1, 1.0):
        rep = _number(body, "repetition_penalty", 1.0, low=0.0)
        if rep <= 0:
            raise APIError(
                "repetition_penalty must be > 0", param="repetition_penalty", code="invalid_value"
            )
        penalties["repetition_penalty"] = rep
    for name in ("presence_penalty", "frequency_penalty"):
        v = _number(body, name, 0.0, low=-2.0, high=2.0)
        if v:
            penalties[name] = v
    bias = body.get("logit_bias")
    if bias:
        vocab = specdec.heads.model_vocab_size(engine.model)
        try:
            penalties["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError) as exc:
            raise APIError(
                "logit_bias must map token ids to numbers", param="logit_bias", code="invalid_value"
            ) from exc
        if vocab is not None and any(not 0 <= t < vocab for t in penalties["logit_bias"]):
            raise APIError(
                f"logit_bias token ids must be in [0, {vocab})",
                param="logit_bias",
                code="invalid_value",
            )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if (
            not isinstance(stop, list)
            or not all(isinstance(s, str) and s for s in stop)
            or len(stop) > 16
        ):
            raise APIError(
                "stop must be a non-empty string or a list of up to 16 of them",
                param="stop",
                code="invalid_value",
            )
    logprobs = _logprobs(body, chat)
    if grammar is None:
        grammar = output_grammar(body)
    elif body.get("response_format") is not None or body.get("grammar") is not None:
        raise APIError(
            "tool_choice required or a named function constrains the answer to a call: "
            "send it without response_format / grammar",
            param="tool_choice",
            code="invalid_value",
        )
    if grammar is not None:
        penalties["grammar"] = grammar
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "seed": seed,
        "stop": stop or None,
        **({} if logprobs is None else {"logprobs": logprobs}),
        **penalties,
    }


def _specdec_object(policy: str, stats: dict) -> dict:
    """The ``specdec`` object of a response: what speculation did for it."""
    per = {
        name: {"drafted": int(d.get("drafted") or 0), "accepted": int(d.get("accepted") or 0)}
        for name, d in (stats.get("per_drafter") or {}).items()
    }
    return {
        "policy": policy,
        "tokens_per_forward": stats.get("tokens_per_forward"),
        "acceptance_rate": stats.get("acceptance_rate") if stats.get("drafted") else None,
        "target_forwards": stats.get("target_forwards"),
        "drafted": stats.get("drafted"),
        "accepted": stats.get("accepted"),
        "per_drafter": per,
        "speculation_off_reason": stats.get("speculation_off_reason"),
        "decode_tps": stats.get("decode_tps"),
        "batch_rows": {str(k): v for k, v in (stats.get("batch_rows") or {}).items()},
    }


def _generation_error(exc: Exception) -> APIError:
    """What a request that failed in the worker answers: the pipeline's refusal of its
    arguments (before any model work) is a 400, anything else a 500."""
    if isinstance(exc, specdec.RequestError):
        return APIError(str(exc), code="invalid_value")
    return APIError(
        f"generation failed: {type(exc).__name__}: {exc}",
        status=500,
        type_="server_error",
        code="generation_failed",
    )


@attrs.frozen
class Finished:
    """A job run to its end (:func:`collect`): its text, the responses of its tokens
    (the stop token's left out), its final stats, finish reason and the stop string
    that ended it (``None``: none did)."""

    text: str
    emitted: list
    stats: dict
    finish: str
    stop_string: str | None


async def collect(job: Job, request: Request) -> Finished | None:
    """Wait for ``job`` to finish (a whole, non-streamed answer); ``None`` when the client
    went away meanwhile (the job is cancelled: its row leaves at the next round).

    Raises:
        the job's error (a failed generation); ``CancelledError`` cancels the job too.
    """
    parts: list[str] = []
    emitted: list = []
    stop = None
    try:
        while True:
            try:
                item = await asyncio.wait_for(job.out.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():  # nobody to answer: stop the work
                    job.cancelled.set()
                    return None
                continue
            if item[0] == "token":
                r = item[1]
                parts.append(r.text)
                if not r.is_stop_token:
                    emitted.append(r)
                if r.finish_reason is not None:
                    stop = r.stop_string
            elif item[0] == "done":
                return Finished("".join(parts), emitted, item[1], item[2], stop)
            else:
                raise item[1]
    except asyncio.CancelledError:
        job.cancelled.set()
        raise


def _usage(prompt_len: int, completion: int, stats: dict) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: the prompt's
    tokens taken from the prefix cache (not prefilled)."""
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {"cached_tokens": int(stats.get("cached_tokens") or 0)},
    }


#: Request bodies larger than this are refused (413), by default: 32 MiB holds a
#: conversation far past any model's context.
DEFAULT_MAX_BODY_BYTES = 32 << 20


class Server:
    """The Starlette app around an :class:`Engine`; ``max_body_bytes``: the largest
    request body read (a larger one is a 413 before it is parsed)."""

    def __init__(self, engine: Engine, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.engine = engine
        self.max_body_bytes = max_body_bytes
        self.app = Starlette(
            routes=[
                Route("/", self.page, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
            ]
        )

    # -- small routes --------------------------------------------------------------------

    async def page(self, request: Request) -> HTMLResponse:
        page = resources.files("specdec_serve").joinpath("page.html").read_text(encoding="utf-8")
        self.engine.metrics.request("/", 200)
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(self.engine.model_name)))

    async def health(self, request: Request) -> JSONResponse:
        e = self.engine
        alive = e._worker.is_alive()
        self.engine.metrics.request("/health", 200 if alive else 503)
        return JSONResponse(
            {
                "status": "ok" if alive else "worker stopped",
                "model": e.model_name,
                "queue_length": e.queue_length,
                "running": e.running,
                "policies": list(e.policy_specs),
                "default_policy": e.default_policy,
                "prefix_cache": e.prefix.stats() if e.prefix is not None else None,
            },
            status_code=200 if alive else 503,
        )

    async def metrics(self, request: Request) -> PlainTextResponse:
        self.engine.metrics.request("/metrics", 200)
        e = self.engine
        prefix = e.prefix.stats() if e.prefix is not None else None
        text = e.metrics.render(e.queue_length, e.running, prefix)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> JSONResponse:
        self.engine.metrics.request("/v1/models", 200)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.engine.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "specdec",
                    }
                ],
            }
        )

    # -- generation ----------------------------------------------------------------------

    async def _raw_body(self, request: Request) -> bytes:
        """The body, read no further than the size limit."""
        limit = self.max_body_bytes
        too_big = APIError(
            f"the request body is larger than this server takes ({limit} bytes; "
            "specdec serve --max-body-bytes)",
            status=413,
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise too_big
        return bytes(data)

    async def _body(self, request: Request) -> dict:
        raw = await self._raw_body(request)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(
                f"the request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.engine.model_name:
            raise APIError(
                f"model {model!r} is not served here; this server serves {self.engine.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )
        return body

    def _policy(self, body: dict) -> str:
        name = body.get("policy")
        if name is not None and not isinstance(name, str):
            raise APIError(
                f"policy must be a policy name, got {name!r}", param="policy", code="invalid_value"
            )
        try:
            return self.engine.resolve_policy(name)
        except specdec.PolicyError as exc:
            raise APIError(str(exc), param="policy", code="unknown_policy") from exc

    def _pipe(self, policy: str, params: dict) -> None:
        """Assemble ``policy``'s pipeline here (no model work) and check the request's
        arguments as it will, so a bad one is a 400 before anything is queued."""
        try:
            pipe = self.engine.pipe(policy)
        except specdec.SpecdecError as exc:
            raise APIError(
                f"policy {policy!r} cannot run on this server: {exc}",
                param="policy",
                code="unknown_policy",
            ) from exc
        try:
            pipe.check_request(**params)
        except specdec.RequestError as exc:
            raise APIError(str(exc), code="invalid_value") from exc

    async def chat(self, request: Request) -> Any:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Any:
        return await self._generate(request, chat=False)

    async def messages(self, request: Request) -> Any:
        """Anthropic's Messages API (its module imports this one, hence here)."""
        from .anthropic import messages

        return await messages(self, request)

    def _tools(self, body: dict, chat: bool) -> tuple[list[dict] | None, dict | None]:
        """The request's tools to render and parse (``None``: no tools, or
        ``tool_choice: "none"``) and the ``grammar`` that forces a call (``tool_choice``
        ``required`` or a named function; else ``None``); checked before any model work."""
        if not chat:
            for name in ("tools", "tool_choice", "functions"):
                if body.get(name) not in (None, [], {}):
                    raise APIError(
                        f"{name} is a chat field: send the request to /v1/chat/completions",
                        param=name,
                        code="unsupported",
                    )
            return None, None
        eng = self.engine
        try:
            tools, choice, names = check_tools(body, eng.tokenizer, eng.model_name)
            if choice == "required":
                assert tools is not None
                return tools, call_grammar(tools, names, eng.tokenizer, eng.model_name)
        except ToolError as exc:
            raise APIError(str(exc), param=exc.param, code="invalid_value") from exc
        return tools, None

    def _prompt(self, body: dict, chat: bool, tools: list[dict] | None = None) -> list[int]:
        if chat:
            try:
                clean = clean_messages(body.get("messages"))
            except ToolError as exc:
                raise APIError(str(exc), param=exc.param, code="invalid_value") from exc
            if not getattr(self.engine.tokenizer, "has_tool_calling", False) and any(
                m["role"] == "tool" or m.get("tool_calls") for m in clean
            ):
                raise APIError(
                    f"{self.engine.model_name}'s chat template has no tool-call format, so "
                    "messages with tool calls or tool results cannot be rendered (the "
                    "template would drop them)",
                    param="messages",
                    code="invalid_value",
                )
            try:
                ids = self.engine.chat_ids(clean, tools)
            except ValueError as exc:
                raise APIError(str(exc), param="messages", code="invalid_value") from exc
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            ):
                ids = list(prompt)
            elif isinstance(prompt, str) and prompt:
                ids = self.engine.text_ids(prompt)
            else:
                raise APIError(
                    "prompt must be a non-empty string or a list of token ids",
                    param="prompt",
                    code="invalid_value",
                )
        vocab = specdec.heads.model_vocab_size(self.engine.model)
        if vocab is not None and any(t < 0 or t >= vocab for t in ids):
            raise APIError(
                f"prompt token ids must be in [0, {vocab})", param="prompt", code="invalid_value"
            )
        if not ids:
            raise APIError("the prompt is empty", param="prompt", code="invalid_value")
        return ids

    async def _generate(self, request: Request, *, chat: bool) -> Any:
        endpoint = request.url.path
        try:
            body = await self._body(request)
            policy = self._policy(body)
            tools, forced = self._tools(body, chat)
            ids = self._prompt(body, chat, tools)
            params = _params(body, self.engine, len(ids), chat=chat, grammar=forced)
            stream = body.get("stream", False)
            if stream is None:
                stream = False
            if not isinstance(stream, bool):
                raise APIError(
                    f"stream must be true or false, got {stream!r}",
                    param="stream",
                    code="invalid_type",
                )
            opts = body.get("stream_options") or {}
            if not isinstance(opts, dict):
                raise APIError(
                    "stream_options must be an object", param="stream_options", code="invalid_type"
                )
            include_usage = opts.get("include_usage", False)
            if not isinstance(include_usage, bool):
                raise APIError(
                    "stream_options.include_usage must be true or false",
                    param="stream_options",
                    code="invalid_type",
                )
            self._pipe(policy, params)  # the policy assembles, and takes these arguments
        except APIError as exc:
            self.engine.metrics.request(endpoint, exc.status)
            return exc.response()
        job = Job(policy, ids, params, asyncio.get_running_loop())
        self.engine.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            self.engine.metrics.request(endpoint, 200)
            return StreamingResponse(
                self._sse(job, rid, created, chat, policy, len(ids), include_usage, tools),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._whole(
            job, rid, created, chat, policy, len(ids), endpoint, request, tools
        )

    def _choice(
        self,
        chat: bool,
        text: str | None,
        finish: str | None,
        *,
        delta: bool,
        tokens: list | None = None,
        offset: int = 0,
        tool_calls: list | None = None,
    ) -> dict:
        """A choice; ``tokens``: the responses (with logprobs) it covers, ``offset`` the
        text's position in the whole answer (completions' ``text_offset``)."""
        lp = self._logprobs(chat, tokens, offset)
        if chat and delta:  # a chunk: the new text, none on the last one
            msg: dict = {} if text is None else {"content": text}
            return {"index": 0, "delta": msg, "finish_reason": finish, "logprobs": lp}
        if chat:
            msg = {"role": "assistant", "content": text or ""}
            if tool_calls:  # OpenAI: content null when the answer is only calls
                msg = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
            return {"index": 0, "message": msg, "finish_reason": finish, "logprobs": lp}
        return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}

    def _splitter(self) -> CallSplitter:
        """A splitter of the answer at the template's tool-call markers."""
        tok = self.engine.tokenizer
        return CallSplitter(tok.tool_call_start, tok.tool_call_end)

    def _released(
        self, events: list[tuple[str, str]], tools: list[dict] | None
    ) -> tuple[str, list[dict]]:
        """Text and parsed calls of a splitter's events; a call the tokenizer's parser
        cannot read goes back into the text as the model wrote it (never dropped)."""
        tok = self.engine.tokenizer
        text, calls = [], []
        for kind, s in events:
            parsed = parse_call(tok.tool_parser, s, tools) if kind == "call" else None
            if parsed is not None:
                calls.extend(parsed)
            elif kind == "call":
                text.append(tok.tool_call_start + s + tok.tool_call_end)
            else:
                text.append(s)
        return "".join(text), calls

    def _logprobs(self, chat: bool, tokens: list | None, offset: int) -> dict | None:
        """OpenAI's logprobs object of the emitted ``tokens`` (StreamResponses), or
        ``None`` when the request did not ask for them: chat's ``{"content": [{token,
        logprob, bytes, top_logprobs}]}``, completions' ``{tokens, token_logprobs,
        top_logprobs, text_offset}``."""
        if not tokens or tokens[0].logprob is None:
            return None
        decode = self.engine.tokenizer.decode

        def entry(t: int, lp: float) -> dict:
            s = decode([t])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        if chat:
            return {
                "content": [
                    {
                        **entry(r.token, r.logprob),
                        "top_logprobs": [entry(t, v) for t, v in r.top_logprobs],
                    }
                    for r in tokens
                ]
            }
        offsets = []
        for r in tokens:
            offsets.append(offset)
            offset += len(r.text)
        return {
            "tokens": [decode([r.token]) for r in tokens],
            "token_logprobs": [r.logprob for r in tokens],
            "top_logprobs": [{decode([t]): v for t, v in r.top_logprobs} for r in tokens],
            "text_offset": offsets,
        }

    async def _whole(
        self,
        job: Job,
        rid: str,
        created: int,
        chat: bool,
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
            self.engine.metrics.request(endpoint, err.status)
            return err.response()
        if done is None:
            return JSONResponse({}, status_code=499)
        self.engine.metrics.request(endpoint, 200)
        text, calls, finish, stats = done.text, None, done.finish, done.stats
        emitted, n = done.emitted, len(done.emitted)
        if tools is not None:
            splitter = self._splitter()
            events = splitter.feed(text) + splitter.finish()
            text, calls = self._released(events, tools)
            if calls and finish == "stop":
                finish = "tool_calls"
        choice = self._choice(
            chat, text, finish, delta=False, tokens=emitted, tool_calls=calls or None
        )
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.engine.model_name,
            "choices": [choice],
            "usage": _usage(n_prompt, n, stats),
            "specdec": _specdec_object(policy, stats),
        }
        return JSONResponse(body)

    async def _sse(
        self,
        job: Job,
        rid: str,
        created: int,
        chat: bool,
        policy: str,
        n_prompt: int,
        include_usage: bool,
        tools: list[dict] | None = None,
    ):
        kind = "chat.completion.chunk" if chat else "text_completion"
        splitter = self._splitter() if tools is not None else None
        n_calls = 0

        def calls_chunks(events: list[tuple[str, str]]) -> tuple[str, list[str]]:
            """The text to send now, and a chunk per parsed tool call (streamed as one
            delta each, ``index`` counting the request's calls)."""
            nonlocal n_calls
            text, calls = self._released(events, tools)
            out = []
            for c in calls:
                delta = {"tool_calls": [{"index": n_calls, **c}]}
                n_calls += 1
                out.append(chunk([{"index": 0, "delta": delta, "finish_reason": None}]))
            return text, out

        def chunk(choices: list, **extra: Any) -> str:
            d = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.engine.model_name,
                "choices": choices,
            }
            d.update(extra)
            return f"data: {json.dumps(d)}\n\n"

        n = 0
        offset = 0  # of the next token's text in the answer
        try:
            if chat:
                yield chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ]
                )
            while True:
                item = await job.out.get()
                if item[0] == "token":
                    r = item[1]
                    if r.is_stop_token:  # not a token of the answer, but it may carry the
                        text, later = r.text, []  # detokenizer's last flushed text
                        if splitter is not None:
                            text, later = calls_chunks(splitter.feed(text))
                        if text:
                            yield chunk([self._choice(chat, text, None, delta=True)])
                        for c in later:
                            yield c
                        continue
                    n += 1
                    fwd = r.stats.target_forwards if r.stats is not None else 0
                    live = {
                        "from_draft": bool(r.from_draft),
                        "tokens_per_forward": round(n / fwd, 3) if fwd else None,
                    }
                    # one chunk per token, also when its text is not complete yet ("")
                    text, later = r.text, []
                    if splitter is not None:  # text inside a tool call is held back
                        text, later = calls_chunks(splitter.feed(r.text))
                    choice = self._choice(chat, text, None, delta=True, tokens=[r], offset=offset)
                    offset += len(r.text)
                    yield chunk([choice], specdec=live)
                    for c in later:
                        yield c
                elif item[0] == "done":
                    stats, finish = item[1], item[2]
                    if splitter is not None:
                        text, later = calls_chunks(splitter.finish())
                        if text:
                            yield chunk([self._choice(chat, text, None, delta=True)])
                        for c in later:
                            yield c
                        if n_calls and finish == "stop":
                            finish = "tool_calls"
                    extra: dict = {"specdec": _specdec_object(policy, stats)}
                    yield chunk(
                        [self._choice(chat, None if chat else "", finish, delta=True)], **extra
                    )
                    if include_usage:
                        yield chunk([], usage=_usage(n_prompt, n, stats))
                    yield "data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps(_generation_error(item[1]).body())}\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:
            job.cancelled.set()  # a client that went away: its row leaves at the next round


def make_app(engine: Engine, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    """The ASGI app serving ``engine`` (request bodies up to ``max_body_bytes``)."""
    return Server(engine, max_body_bytes).app
