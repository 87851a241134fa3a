"""The ``specdec`` command: ``generate``, ``bench``, ``plugins``, ``doctor``.

Every error that comes from bad input (a flag value, a policy, a model path)
is one line ``specdec: error: ...`` on stderr and exit status 2, before any
model is loaded. ``SPECDEC_DEBUG=1`` shows the traceback as well.

Layout: :mod:`specdec.cli.common` holds what the subcommands share (exit
codes, :class:`CliError`, JSON output, model-spec and policy checks);
:mod:`specdec.cli.generate` and :mod:`specdec.cli.info` (``plugins``,
``doctor``) are subcommands, as is :mod:`specdec.bench.command` (``bench``).
This module builds the parser and runs :func:`main`, the console script.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .. import blas
from .common import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    Parser,
    debug_enabled,
    print_error,
)
from .generate import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PROMPT,
    add_generate_parser,
    build_policy,
    cmd_generate,
    format_stats_line,
)
from .info import add_doctor_parser, add_plugins_parser, cmd_doctor, cmd_plugins, doctor_report

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROMPT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROG",
    "SUBCOMMANDS",
    "CliError",
    "build_parser",
    "build_policy",
    "cmd_bench",
    "cmd_doctor",
    "cmd_generate",
    "cmd_plugins",
    "doctor_report",
    "format_stats_line",
    "main",
]


# -- bench (specdec.bench, imported only when the command runs) -----------------


def cmd_bench(args: argparse.Namespace) -> int:
    from ..bench.command import cmd_bench as run

    return run(args)


def _add_bench(sub: Any) -> None:
    from ..bench.command import add_bench_parser

    add_bench_parser(sub, func=cmd_bench)


# -- the parser ----------------------------------------------------------------

#: Subcommands, in --help order.
SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    add_generate_parser,
    _add_bench,
    add_plugins_parser,
    add_doctor_parser,
)


def _add_plugin_commands(sub: Any) -> None:
    """Subcommands that installed plugins add through the ``specdec_register_commands``
    hook. An implementation that raises, or whose command name is taken, is left out
    with a warning on stderr; the other commands still work."""
    import argparse as _argparse

    from ..plugins import get_plugin_host

    try:
        pm = get_plugin_host().pm
    except Exception as exc:  # plugins that cannot be loaded: the core's commands remain
        print(f"{PROG}: warning: plugin commands not loaded: {exc}", file=sys.stderr)
        return
    for impl in pm.hook.specdec_register_commands.get_hookimpls():
        before, shown = dict(sub.choices), list(sub._choices_actions)
        try:
            impl.function(subparsers=_NoOverride(sub))
            continue
        except _argparse.ArgumentError as exc:
            why = str(exc)
        except (Exception, SystemExit) as exc:  # a plugin bug, or parser.error()/exit()
            why = f"its commands could not be added: {type(exc).__name__}: {exc}"
        # Leave the plugin's commands out altogether: --help must not list them.
        for name in set(sub.choices) - set(before):
            sub.choices.pop(name, None)
        sub._choices_actions[:] = shown
        print(f"{PROG}: warning: plugin {impl.plugin_name!r}: {why}", file=sys.stderr)


class _NoOverride:
    """The subparsers action as a plugin sees it: adding a taken name (or alias) is refused."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        for n in (name, *kwargs.get("aliases", ())):
            if n in self._sub.choices:
                raise argparse.ArgumentError(None, f"command {n!r} is left out: the name is taken")
        return self._sub.add_parser(name, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._sub, attr)


def build_parser() -> argparse.ArgumentParser:
    import specdec

    parser = Parser(
        prog=PROG,
        description="Plugin-based speculative decoding for MLX.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {specdec.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
    _add_plugin_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``specdec`` command; returns the exit status.

    With ``argv=None`` (the console script) the process may first re-execute
    itself with a fast BLAS preloaded (see :mod:`specdec.blas`).
    """
    if argv is None:
        blas.reexec_with_fast_blas()
        argv = sys.argv[1:]
    parser = build_parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as exc:  # --help, --version, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    import specdec

    try:
        return int(args.func(args) or 0)
    except (CliError, specdec.SpecdecError) as exc:
        if debug_enabled():
            traceback.print_exc()
        print_error(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stdout.flush()
        print_error("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
