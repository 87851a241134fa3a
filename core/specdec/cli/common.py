"""What every ``specdec`` subcommand shares: exit codes, errors, JSON output, model specs.

The subcommands (:mod:`specdec.cli.generate`, :mod:`specdec.cli.info`,
:mod:`specdec.bench.command`) import these public names; nothing outside this
module relies on its private ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, NoReturn, TextIO

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "CliError",
    "Parser",
    "check_model_spec",
    "check_policy_components",
    "debug_enabled",
    "default_model",
    "fmt",
    "json_default",
    "looks_like_local_path",
    "print_error",
    "print_json",
    "read_prompt",
]

PROG = "specdec"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CliError(Exception):
    """A bad command line: printed as ``specdec: error: <message>``, exit 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``specdec: error:`` line."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        sub = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        self.exit(
            EXIT_USAGE,
            f"{PROG}: error: {message} (see '{PROG} {sub}--help')\n",
        )


def print_error(message: str) -> None:
    """``specdec: error: <message>`` on stderr."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def debug_enabled() -> bool:
    """``SPECDEC_DEBUG`` is set (to anything but ``0``): show tracebacks."""
    return os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")


def print_json(obj: Any, out: TextIO | None = None) -> None:
    """``obj`` as indented JSON on ``out`` (stdout by default)."""
    out = out or sys.stdout
    out.write(json.dumps(obj, indent=2, sort_keys=False, default=json_default) + "\n")
    out.flush()


def json_default(obj: Any) -> Any:
    """JSON for what :mod:`json` does not know: ``to_dict()``, sets, paths, scalars."""
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    try:  # numpy / mlx scalars
        return obj.item()
    except Exception:
        return repr(obj)


def looks_like_local_path(spec: str) -> bool:
    """True for a model spec meant as a local folder rather than a Hub id ``org/name``."""
    if spec.startswith(("/", ".", "~")) or (os.altsep and os.altsep in spec):
        return True
    return not _HUB_ID.match(spec)


def check_model_spec(spec: str, flag: str) -> str:
    """Fail early for a model path that does not exist (Hub ids pass through)."""
    expanded = os.path.expanduser(spec)
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            raise CliError(f"{flag} {spec!r} is a file; expected a model folder or a Hub id")
        return expanded
    if looks_like_local_path(spec):
        raise CliError(
            f"{flag} {spec!r}: no such folder (expected a local model folder with "
            "config.json and *.safetensors, or a Hugging Face id like org/name)"
        )
    return spec


def default_model() -> str:
    """The built-in default model's folder, prepared on first use."""
    try:
        from ..models.default import default_model_path  # type: ignore[import-not-found]
    except ImportError as exc:
        raise CliError(
            "no --model given and the built-in default model is not available "
            f"({exc}); pass --model PATH"
        ) from exc
    try:
        return os.fspath(default_model_path())
    except Exception as exc:  # the provider says why (missing package, checksum, ...)
        raise CliError(
            f"no --model given and the built-in default model could not be prepared: {exc}; "
            "pass --model PATH"
        ) from exc


def read_prompt(prompt: str) -> str:
    """The prompt text; ``-`` reads it from stdin."""
    if prompt == "-":
        if sys.stdin is None:
            raise CliError("--prompt - reads the prompt from stdin, but there is no stdin")
        text = sys.stdin.read()
        if not text.strip():
            raise CliError("--prompt - read an empty prompt from stdin")
        return text
    return prompt


def check_policy_components(policy: Any) -> None:
    """Resolve every component name the policy uses against the installed plugins."""
    import specdec

    host = specdec.get_plugin_host()
    wanted: list[tuple[str, str]] = [("drafter", d) for d in policy.drafters]
    if policy.governor:
        wanted.append(("governor", policy.governor))
    if policy.verifier != "auto":
        wanted.append(("verifier", policy.verifier))
    if policy.acceptor != "auto":
        wanted.append(("acceptor", policy.acceptor))
    if policy.rollback != "auto":
        wanted.append(("cache_rollback", policy.rollback))
    for role, name in wanted:
        host.get(role, name)  # raises UnknownComponentError with the installed names


def fmt(value: Any, spec: str, missing: str = "n/a") -> str:
    """``format(value, spec)``; ``missing`` for None, ``str(value)`` when it does not format."""
    if value is None:
        return missing
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)
