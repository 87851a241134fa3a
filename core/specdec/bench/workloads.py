"""The benchmark's workloads: real text shipped with the package, never generated at run time.

Each workload is described in ``specdec/data/bench/workloads.toml``; its texts live
next to it (``*.txt``, with their licences in ``specdec/data/bench/NOTICE.md``).
A workload's prompt is its ``template`` with ``{source}`` replaced by the source
text, encoded through the model's chat template when ``chat_template`` is true,
followed by ``answer_prefix`` encoded as raw text (the first characters of the
answer, so that a small model starts where the answer starts). When the
workload has an ``expected`` answer, :func:`faithfulness` says how much of it
the output reproduced.

A workload may have a ``prelude``: a first request (a template like ``template``,
through the chat template when ``chat_template`` is true) that the runner sends,
untimed, on the same pipeline right before every run of every contender, so
that what a drafter keeps across requests (``ngram_copy``'s store) holds its
output when the measured request starts; see :func:`~specdec.bench.run_bench`.
"""

from __future__ import annotations

import difflib
import json
import sys
from collections.abc import Sequence
from importlib import resources
from typing import Any

import attrs

from ..errors import RequestError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Workload",
    "faithfulness",
    "get_workloads",
    "load_workloads",
    "workload_names",
]

_DATA = ("specdec", "data", "bench")


def _data_file(name: str) -> Any:
    root = resources.files(_DATA[0])
    for part in (*_DATA[1:], *name.split("/")):
        root = root / part
    return root


def _read(name: str) -> str:
    return _data_file(name).read_text(encoding="utf-8")


@attrs.frozen
class Workload:
    """One benchmark task.

    Attributes:
        name: the ``--workload`` name.
        description: one line for the table and ``--help``.
        template: the user's request; ``{source}`` is replaced by :attr:`source`.
        source: the text the answer copies from ("" for none).
        expected: the expected answer (the whole of it), or ``None`` when there is no
            single right answer (``prose``).
        chat_template: encode the request through the tokenizer's chat template.
        answer_prefix: raw text appended after the (templated) request: the first
            characters of the answer. It counts as part of the output when the
            output is compared with :attr:`expected`.
        license: where the text comes from and under which licence.
        prelude: a first request (``{source}`` is replaced by :attr:`source`) run
            untimed before every run of the measured one ("" for none).
        grammar: the request's ``grammar`` (constrained decoding: a ``schema`` file in
            the manifest is ``{"json_schema": ...}``), or ``None``.
        default: run when no workload is named (the constrained ones run when named).
    """

    name: str
    description: str
    template: str
    source: str = ""
    expected: str | None = None
    chat_template: bool = True
    answer_prefix: str = ""
    license: str = ""
    prelude: str = ""
    grammar: dict | None = None
    default: bool = True

    @property
    def request(self) -> str:
        """The user's request with the source text in it."""
        return self.template.replace("{source}", self.source)

    def prompt_ids(self, pipe: Any) -> list[int]:
        """The prompt's token ids for ``pipe`` (a :class:`specdec.Pipeline`)."""
        ids = pipe.encode_prompt(self.request, chat_template=self.chat_template)
        if self.answer_prefix:
            ids = ids + _encode_raw(pipe.tokenizer, self.answer_prefix)
        return ids

    @property
    def prelude_request(self) -> str:
        """The prelude request with the source text in it ("" without a prelude)."""
        return self.prelude.replace("{source}", self.source)

    def prelude_ids(self, pipe: Any) -> list[int] | None:
        """The prelude's prompt token ids for ``pipe`` (``None`` without a prelude)."""
        if not self.prelude:
            return None
        return pipe.encode_prompt(self.prelude_request, chat_template=self.chat_template)

    def faithfulness(self, output: str, *, complete: bool = False) -> float | None:
        """:func:`faithfulness` of ``answer_prefix + output`` to :attr:`expected` (``None`` without one)."""
        if self.expected is None:
            return None
        return faithfulness(self.answer_prefix + output, self.expected, complete=complete)


def _encode_raw(tokenizer: Any, text: str) -> list[int]:
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # tokenizers without the keyword (e.g. the test kit's)
        ids = tokenizer.encode(text)
    return [int(t) for t in ids]


def _strip_fence(text: str) -> tuple[str, bool]:
    """Drop an opening Markdown code fence line; cut at the closing one (``True``: cut there)."""
    lines = text.split("\n")
    if lines and lines[0].lstrip().startswith("```"):
        lines = lines[1:]
    for i, ln in enumerate(lines):
        if ln.strip() == "```":
            return "\n".join(lines[:i]) + "\n", True
    return "\n".join(lines), False


def faithfulness(output: str, expected: str, *, complete: bool = False) -> float:
    """The share of the expected answer's lines that the output reproduced, in order.

    A Markdown code fence around the output is ignored (the text after its closing
    fence is not compared). Lines are compared without trailing whitespace, as
    matching blocks of :class:`difflib.SequenceMatcher`; the result is the number of
    matched lines divided by the number of lines compared, so invented or looping
    text scores low and text past the end of the answer counts against it.

    Args:
        output: the model's answer.
        expected: the right answer.
        complete: the output ended by itself (a stop token). Otherwise it may have
            been cut by ``max_tokens``: its last, possibly partial, line is left out
            and only as many expected lines as it has complete lines are compared.
    """
    text, closed = _strip_fence(output)
    complete = complete or closed
    out_lines = [ln.rstrip() for ln in text.split("\n")]
    exp_lines = [ln.rstrip() for ln in expected.split("\n")]
    while exp_lines and not exp_lines[-1]:
        exp_lines.pop()
    if complete:
        while out_lines and not out_lines[-1]:
            out_lines.pop()
    else:
        if len(out_lines) > 1:
            out_lines = out_lines[:-1]  # the last line may be cut by max_tokens
        exp_lines = exp_lines[: len(out_lines)]
        if len(out_lines) == 1:  # not one complete line: compare the partial one
            return 1.0 if exp_lines and expected.startswith(out_lines[0]) else 0.0
    if not exp_lines:
        return 0.0
    sm = difflib.SequenceMatcher(None, out_lines, exp_lines, autojunk=False)
    matched = sum(b.size for b in sm.get_matching_blocks())
    return matched / max(len(exp_lines), len(out_lines))


def load_workloads() -> dict[str, Workload]:
    """Every shipped workload, by name, in their manifest's order."""
    manifest = tomllib.loads(_read("workloads.toml"))
    out: dict[str, Workload] = {}
    for w in manifest.get("workload", []):
        out[w["name"]] = Workload(
            name=w["name"],
            description=w.get("description", ""),
            template=w["template"],
            source=_read(w["source"]) if w.get("source") else "",
            expected=_read(w["expected"]) if w.get("expected") else None,
            chat_template=bool(w.get("chat_template", True)),
            answer_prefix=w.get("answer_prefix", ""),
            license=w.get("license", ""),
            prelude=w.get("prelude", ""),
            grammar={"json_schema": json.loads(_read(w["schema"]))} if w.get("schema") else None,
            default=bool(w.get("default", True)),
        )
    return out


def workload_names() -> list[str]:
    """The shipped workloads' names."""
    return list(load_workloads())


def get_workloads(names: Sequence[str] | None = None) -> list[Workload]:
    """The named workloads (the default ones when ``names`` is empty or ``None``: all but
    the constrained ones), without duplicates.

    Raises:
        RequestError: an unknown name, listing the shipped ones.
    """
    all_ = load_workloads()
    if not names:
        return [w for w in all_.values() if w.default]
    out: list[Workload] = []
    for n in names:
        if n not in all_:
            raise RequestError(f"unknown workload {n!r}: expected one of {', '.join(all_)}")
        if all_[n] not in out:
            out.append(all_[n])
    return out
