"""Tool calls for ``/v1/chat/completions`` (and ``/v1/messages``, which translates
Anthropic's tools and blocks to these shapes): ``tools`` rendered through the model's
chat template, the calls the model writes parsed with mlx-lm's parser for that template.

mlx-lm's tokenizer wrapper finds a model's tool-call format from its chat template
(``has_tool_calling``, ``tool_call_start`` / ``tool_call_end`` markers and a
``tool_parser(text, tools)`` from ``mlx_lm/tool_parsers/``), as ``mlx_lm.server`` uses
it. Unlike ``mlx_lm.server``, which warns and renders the tools anyway, a request with
tools for a template that has no tool-call format is refused (400), and a call the
parser cannot read is returned as text rather than dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

#: Roles a chat message may have.
ROLES = ("system", "developer", "user", "assistant", "tool")


class ToolError(ValueError):
    """A request's tools, tool_choice or messages the server refuses: ``param`` names
    the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tools(
    body: dict, tokenizer: Any, model_name: str
) -> tuple[list[dict] | None, str, list[str]]:
    """The request's ``tools`` to render (``None``: none, or ``tool_choice: "none"``), its
    ``tool_choice`` (``"auto"``, ``"none"``, or ``"required"`` for ``required`` and a
    named function) and the functions a ``required`` call may name (the named one, or
    all of them).

    Raises:
        ToolError: malformed tools, a tool_choice naming a function the request does
            not define, or tools for a chat template without a tool-call format.
    """
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if body.get("functions") or body.get("function_call"):
        raise ToolError(
            "functions / function_call are OpenAI's deprecated fields: send tools and tool_choice",
            "functions",
        )
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return None, "none", []
    if not isinstance(tools, list):
        raise ToolError("tools must be a list of {type: function, function: {...}}", "tools")
    names: list[str] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", '
                f'"description", "parameters"}}}}, got {t!r:.200}',
                "tools",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        if name in names:
            raise ToolError(f"tools[{i}]: two tools are named {name!r}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        names.append(name)
    if choice is None:
        choice = "auto"
    allowed = names
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolError(
                'tool_choice must be "auto", "none", "required" or {"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r:.200}',
                "tool_choice",
            )
        if name not in names:
            raise ToolError(
                f"tool_choice names function {name!r}; the request's tools are {', '.join(names)}",
                "tool_choice",
            )
        choice, allowed = "required", [name]
    if choice not in ("auto", "none", "required"):
        raise ToolError(
            f'tool_choice must be "auto", "none", "required" or a named function, got {choice!r}',
            "tool_choice",
        )
    if choice == "none":
        return None, "none", []
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ToolError(
            f"{model_name}'s chat template has no tool-call format (mlx-lm finds none in it), "
            "so it cannot be given tools: send the request without tools",
            "tools",
        )
    return tools, choice, allowed if choice == "required" else []


#: mlx-lm's tool parser whose calls are a JSON object ``{"name", "arguments"}`` between
#: the template's markers: the format a forced call (``tool_choice`` ``required`` or a
#: named function) is constrained to.
JSON_CALLS = "mlx_lm.tool_parsers.json_tools"


def _hoisted(params: dict, prefix: str, defs: dict) -> dict:
    """A tool's ``parameters`` schema to nest in the call's schema: its ``$defs`` /
    ``definitions`` moved into ``defs`` (the call schema's root ``$defs``) under
    ``prefix``-ed names and its local ``$ref``s rewritten to them, so they still resolve;
    its ``$schema`` dropped (the call schema's root has none)."""
    params = {k: v for k, v in params.items() if k != "$schema"}
    moved: dict[str, str] = {}
    tables: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        table = params.pop(key, None)
        if isinstance(table, dict):
            for name, sub in table.items():
                moved[f"#/{key}/{name}"] = f"#/$defs/{prefix}{name}"
                tables[f"{prefix}{name}"] = sub

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: moved.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        return node

    for name, sub in tables.items():
        defs[name] = rewrite(sub)
    return rewrite(params)


def call_grammar(tools: list[dict], names: list[str], tokenizer: Any, model_name: str) -> dict:
    """The request ``grammar`` (a Lark grammar with an embedded JSON schema) that forces one
    call of a function in ``names`` with arguments valid for its ``parameters``: the
    template's start marker, ``{"name": ..., "arguments": {...}}``, its end marker.

    Raises:
        ToolError: the chat template's tool-call format is not mlx-lm's JSON one.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", None)
    if module != JSON_CALLS:
        raise ToolError(
            f"tool_choice required or a named function: {model_name}'s tool-call format "
            f"({module or 'unknown'}) is not one this server can force; it forces JSON calls "
            f"({JSON_CALLS}); use tool_choice auto",
            "tool_choice",
        )
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    defs: dict[str, Any] = {}
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": n},
                "arguments": _hoisted(
                    by_name[n].get("parameters") or {"type": "object"}, f"tool{i}_", defs
                ),
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for i, n in enumerate(names)
    ]
    schema: dict[str, Any] = {"anyOf": variants, "x-guidance": {"whitespace_flexible": False}}
    if defs:
        schema["$defs"] = defs
    start, end = json.dumps(tokenizer.tool_call_start), json.dumps(tokenizer.tool_call_end)
    lark = f"start: {start} /[ \\n]*/ call /[ \\n]*/ {end}\ncall: %json {json.dumps(schema)}"
    return {"lark": lark}


def clean_messages(messages: Any) -> list[dict]:
    """Chat messages as the chat template takes them: content parts joined into text,
    an assistant's ``tool_calls`` with their JSON ``arguments`` decoded (templates
    render them as objects, as ``mlx_lm.server`` passes them), a tool result's
    ``tool_call_id`` and ``name`` kept.

    Raises:
        ToolError: not a non-empty list, an unknown role, content that is not text.
    """
    if not isinstance(messages, list) or not messages:
        raise ToolError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolError(f"messages[{i}] must be an object with a role and content", "messages")
        role = m["role"]
        if role not in ROLES:
            raise ToolError(
                f"messages[{i}] has role {role!r}; accepted are {', '.join(ROLES)}", "messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ToolError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None and not isinstance(calls, list):
            raise ToolError(
                f"messages[{i}].tool_calls must be a list of calls, got {calls!r:.100}",
                "messages",
            )
        if content is None and calls:
            content = ""
        if not isinstance(content, str):
            raise ToolError(f"messages[{i}].content must be text", "messages")
        msg: dict = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            msg["tool_calls"] = [_decoded_call(i, c) for c in calls]
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if isinstance(m.get(k), str):
                    msg[k] = m[k]
        out.append(msg)
    return out


def _decoded_call(i: int, call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError(
            f"messages[{i}].tool_calls: each needs a function with a name and arguments",
            "messages",
        )
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolError(
                f"messages[{i}].tool_calls: arguments of {fn['name']!r} are not JSON: {exc}",
                "messages",
            ) from exc
    out = dict(call)
    out["function"] = {**fn, "arguments": args if args is not None else {}}
    return out


class CallSplitter:
    """Splits generated text into answer text and tool calls, as it streams.

    ``feed(text)`` returns what can be released now: ``("text", s)`` and ``("call",
    raw)`` items, where ``raw`` is the text between the template's start and end markers.
    Text that could be the beginning of a start marker is held back until it cannot.
    """

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self._in_call:
                # a format without an end marker (mlx-lm's mistral): the call runs to
                # the end of the answer (finish)
                j = self._buf.find(self.end) if self.end else -1
                if j < 0:
                    return out
                out.append(("call", self._buf[:j]))
                self._buf = self._buf[j + len(self.end) :]
                self._in_call = False
                continue
            j = self._buf.find(self.start)
            if j >= 0:
                if j:
                    out.append(("text", self._buf[:j]))
                self._buf = self._buf[j + len(self.start) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, self.start)
            cut = len(self._buf) - keep
            if cut:
                out.append(("text", self._buf[:cut]))
                self._buf = self._buf[cut:]
            return out

    def finish(self) -> list[tuple[str, str]]:
        """What is left when generation ends: held-back text, and a call that never
        reached its end marker as the text it is (nothing is dropped); with a format
        that has no end marker, the call that ran to the end."""
        if self._in_call and not self.end:
            raw, self._buf, self._in_call = self._buf, "", False
            return [("call", raw)]
        rest = (self.start if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [("text", rest)] if rest else []


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_call(
    parser: Callable[[str, Any], Any], raw: str, tools: list[dict] | None
) -> list[dict] | None:
    """OpenAI ``tool_calls`` entries for one call's text (``None`` when the parser
    cannot read it: the caller returns it as text)."""
    try:
        parsed = parser(raw, tools)
    except Exception:  # noqa: BLE001 - whatever the parser raises: the text goes back as text
        return None
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for c in calls:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str):
            return None
        args = c.get("arguments", {})
        out.append(
            {
                "id": str(c.get("id") or "call_" + uuid.uuid4().hex[:24]),
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": args
                    if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    return out
