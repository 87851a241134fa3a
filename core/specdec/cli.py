"""The ``specdec`` command: ``generate``, ``plugins``, ``doctor`` (``bench``: issue 3).

Every error that comes from bad input (a flag value, a policy, a model path)
is one line ``specdec: error: ...`` on stderr and exit status 2, before any
model is loaded. ``SPECDEC_DEBUG=1`` shows the traceback as well.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

from . import blas

PROG = "specdec"
EXIT_OK = 0
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

#: mlx_lm.generate's defaults, except --max-tokens (256 here).
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 256

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class CliError(Exception):
    """A bad command line: printed as ``specdec: error: <message>``, exit 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one ``specdec: error:`` line."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        sub = self.prog.split(" ", 1)[1] + " " if " " in self.prog else ""
        self.exit(
            EXIT_USAGE,
            f"{PROG}: error: {message} (see '{PROG} {sub}--help')\n",
        )


# -- helpers -------------------------------------------------------------------


def _err(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)


def _debug() -> bool:
    return os.environ.get("SPECDEC_DEBUG", "") not in ("", "0")


def _print_json(obj: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    out.flush()


def _json_default(obj: Any) -> Any:
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


def _looks_like_local_path(spec: str) -> bool:
    """True for a model spec meant as a local folder rather than a Hub id ``org/name``."""
    if spec.startswith(("/", ".", "~")) or (os.altsep and os.altsep in spec):
        return True
    return not _HUB_ID.match(spec)


def _check_model_spec(spec: str, flag: str) -> str:
    """Fail early for a model path that does not exist (Hub ids pass through)."""
    expanded = os.path.expanduser(spec)
    if os.path.exists(expanded):
        if not os.path.isdir(expanded):
            raise CliError(f"{flag} {spec!r} is a file; expected a model folder or a Hub id")
        return expanded
    if _looks_like_local_path(spec):
        raise CliError(
            f"{flag} {spec!r}: no such folder (expected a local model folder with "
            "config.json and *.safetensors, or a Hugging Face id like org/name)"
        )
    return spec


def _default_model() -> str:
    try:
        from .models.default import default_model_path  # type: ignore[import-not-found]
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


def _read_prompt(prompt: str) -> str:
    if prompt == "-":
        if sys.stdin is None:
            raise CliError("--prompt - reads the prompt from stdin, but there is no stdin")
        text = sys.stdin.read()
        if not text.strip():
            raise CliError("--prompt - read an empty prompt from stdin")
        return text
    return prompt


def _check_policy_components(policy: Any) -> None:
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


def _fmt(value: Any, spec: str, missing: str = "n/a") -> str:
    if value is None:
        return missing
    try:
        return format(value, spec)
    except (TypeError, ValueError):
        return str(value)


def format_stats_line(stats: dict, *, policy: str = "", generated: int | None = None) -> str:
    """The one-line ``--stats`` summary."""
    parts = []
    if policy:
        parts.append(f"policy={policy}")
    n = generated if generated is not None else stats.get("generation_tokens")
    if n is not None:
        parts.append(f"{n} tokens")
    parts.append(f"prompt {_fmt(stats.get('prompt_tps'), '.1f')} tok/s")
    parts.append(f"decode {_fmt(stats.get('decode_tps'), '.1f')} tok/s")
    parts.append(f"{_fmt(stats.get('tokens_per_forward'), '.2f')} tokens/forward")
    fwd = stats.get("target_forwards")
    if fwd is not None:
        parts.append(f"{fwd} target forwards")
    acc = stats.get("acceptance_rate")
    acc_s = "n/a" if acc is None or not stats.get("drafted") else f"{100.0 * acc:.1f}%"
    parts.append(
        f"acceptance {acc_s} ({_fmt(stats.get('accepted'), 'd', '0')}/"
        f"{_fmt(stats.get('drafted'), 'd', '0')})"
    )
    mem = stats.get("peak_memory_gb")
    if mem is not None:
        parts.append(f"peak {_fmt(mem, '.2f')} GB")
    off = stats.get("speculation_off_reason")
    if off:
        parts.append(f"speculation off: {off}")
    return f"{PROG}: " + " | ".join(parts)


# -- generate ------------------------------------------------------------------


def _add_generate(sub: Any) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text from a prompt (flags follow mlx_lm.generate).",
    )
    p.add_argument(
        "--model",
        default=None,
        help="local model folder or Hugging Face id (default: the built-in default model)",
    )
    p.add_argument(
        "--prompt",
        "-p",
        default=DEFAULT_PROMPT,
        help=f"the prompt, or '-' to read it from stdin (default: {DEFAULT_PROMPT!r})",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"maximum number of tokens to generate (default: {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p, in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, help="top-k, 0 = off (default: 0)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p, 0 = off (default: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    p.add_argument("--system-prompt", default=None, help="system prompt for the chat template")
    p.add_argument(
        "--policy",
        default="none",
        help="a preset name (none, copy, ngram, draft) or a policy .toml file (default: none)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a smaller model with the same tokenizer; adds the draft_model drafter",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="the largest block verified in one forward (sets the policy's max_block)",
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print one summary line on stderr: tok/s, tokens per forward, acceptance",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, stats) on stdout instead of streaming",
    )
    p.set_defaults(func=cmd_generate)


def _build_policy(args: argparse.Namespace) -> Any:
    import attrs

    import specdec

    policy = specdec.load_policy(args.policy)
    if args.draft_model is not None:
        draft = _check_model_spec(args.draft_model, "--draft-model")
        if "draft_model" not in policy.drafters:
            policy = attrs.evolve(
                policy,
                name=f"{policy.name}+draft_model",
                drafters=(*policy.drafters, "draft_model"),
            )
        policy = policy.with_options("draft_model", model=draft)
    if args.num_draft_tokens is not None:
        if args.num_draft_tokens < 1:
            raise CliError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
        policy = attrs.evolve(
            policy,
            max_block=args.num_draft_tokens,
            min_block=min(policy.min_block, args.num_draft_tokens),
        )
    _check_policy_components(policy)
    return policy


def cmd_generate(args: argparse.Namespace) -> int:
    import specdec

    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    # 1. everything that can be checked without a model
    specdec.validate_request(max_tokens=args.max_tokens, **sampling)
    policy = _build_policy(args)
    model = _check_model_spec(args.model, "--model") if args.model else None
    prompt = _read_prompt(args.prompt)
    if model is None:
        model = _default_model()

    # 2. the model
    try:
        pipe = specdec.assemble(model, policy=policy)
    except specdec.SpecdecError:
        raise
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load model {model!r}: {exc}") from exc

    ids = pipe.encode_prompt(
        prompt, chat_template=not args.ignore_chat_template, system_prompt=args.system_prompt
    )
    kwargs = dict(max_tokens=args.max_tokens, seed=args.seed, **sampling)

    if args.json:
        out = pipe.generate(ids, **kwargs)
        stats = out.stats.to_dict() if out.stats is not None else {}
        _print_json(
            {
                "model": str(model),
                "policy": policy.name,
                "text": out.text,
                "tokens": [int(t) for t in out.tokens],
                "finish_reason": out.finish_reason,
                "stats": stats,
            }
        )
        if args.stats:
            print(
                format_stats_line(stats, policy=policy.name, generated=len(out.tokens)),
                file=sys.stderr,
                flush=True,
            )
        return EXIT_OK

    stats_obj = None
    n = 0
    for r in pipe.stream(ids, **kwargs):
        n += 1
        if r.text:
            sys.stdout.write(r.text)
            sys.stdout.flush()
        if getattr(r, "stats", None) is not None:
            stats_obj = r.stats
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        stats = stats_obj.to_dict() if stats_obj is not None else {}
        print(
            format_stats_line(stats, policy=policy.name, generated=n), file=sys.stderr, flush=True
        )
    return EXIT_OK


# -- plugins -------------------------------------------------------------------


def _add_plugins(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list installed plugins, their components and load failures",
        description="List installed specdec plugins, their components and load failures.",
    )
    p.add_argument("--all", action="store_true", help="include the built-in components")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)


def _format_plugins(info: dict, *, include_builtins: bool) -> str:
    lines = [f"specdec-core {info.get('core_version', '?')}"]
    plugins = info.get("plugins", [])
    if plugins:
        lines.append("plugins:")
        for p in plugins:
            lines.append(f"  {p['name']}  ({p['distribution']} {p['version']})")
            for role, names in sorted(p.get("components", {}).items()):
                lines.append(f"    {role}: {', '.join(names)}")
    elif include_builtins:
        lines.append("plugins: none")
    else:
        lines.append("plugins: no third-party plugins installed (--all shows the built-ins)")
    failures = info.get("failures", [])
    if failures:
        lines.append("failed to load:")
        for f in failures:
            lines.append(
                f"  {f['entry_point']}  ({f['distribution']} {f['version']}, "
                f"core {f['core_version']}): {f['error']}"
            )
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    import specdec

    info = specdec.get_plugin_host().to_dict(include_builtins=args.all)
    if args.json:
        _print_json(info)
    else:
        print(_format_plugins(info, include_builtins=args.all), flush=True)
    return EXIT_OK


# -- doctor --------------------------------------------------------------------


def _add_doctor(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="versions, device, BLAS in use, matmul speed, plugins",
        description="Report what specdec runs on: versions, device, BLAS and its speed, plugins.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_doctor)


def _dist_version(name: str) -> str | None:
    import importlib_metadata

    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    """Everything ``specdec doctor`` reports, as a JSON-able dict."""
    import mlx.core as mx

    import specdec

    host_info = specdec.get_plugin_host().to_dict(include_builtins=True)
    try:
        metal = bool(mx.metal.is_available())
    except Exception:
        metal = False
    try:
        cuda = bool(mx.cuda.is_available())  # type: ignore[attr-defined]
    except Exception:
        cuda = False
    blas_info = blas.blas_report(measure=True)
    advice = []
    if blas_info["active_is_reference"] and sys.platform.startswith("linux"):
        if blas_info["fast_blas_disabled"]:
            advice.append(f"{blas.ENV_DISABLE} is set: unset it to use a fast BLAS")
        elif not blas_info["fast_blas_candidates"]:
            advice.append(
                "mlx uses its bundled reference BLAS (slow on the CPU); install OpenBLAS: "
                "apt-get install -y libopenblas0-pthread"
            )
        else:
            advice.append(
                "a fast BLAS is installed but not in use: import specdec before mlx, or set "
                f"LD_PRELOAD={blas_info['fast_blas_candidates'][0]}"
            )
    return {
        "specdec_core": specdec.__version__,
        "python": {
            "version": platform.python_version(),
            "implementation": platform.python_implementation(),
            "executable": sys.executable,
        },
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "mlx": getattr(mx, "__version__", None) or _dist_version("mlx"),
        "mlx_cpu": _dist_version("mlx-cpu"),
        "mlx_lm": _dist_version("mlx-lm"),
        "device": str(mx.default_device()),
        "metal_available": metal,
        "cuda_available": cuda,
        "blas": blas_info,
        "matmul_gflops": blas_info.get("matmul_gflops"),
        "plugins": [
            {"name": p["name"], "distribution": p["distribution"], "version": p["version"]}
            for p in host_info["plugins"]
        ],
        "plugin_failures": host_info["failures"],
        "advice": advice,
    }


def _format_doctor(r: dict) -> str:
    b = r["blas"]
    st = b.get("ensure_fast_blas") or {}
    lines = [
        f"specdec-core  {r['specdec_core']}",
        f"python        {r['python']['version']} ({r['python']['executable']})",
        f"platform      {r['platform']}, {r['cpu_count']} CPUs",
        f"mlx           {r['mlx']}" + (f" (mlx-cpu {r['mlx_cpu']})" if r["mlx_cpu"] else ""),
        f"mlx-lm        {r['mlx_lm']}",
        f"device        {r['device']}"
        + (" (metal available)" if r["metal_available"] else "")
        + (" (cuda available)" if r["cuda_available"] else ""),
        f"blas in use   {b['active'] or 'unknown'}"
        + (" (reference BLAS: slow)" if b["active_is_reference"] else ""),
        f"blas mapped   {', '.join(b['loaded_libraries']) or 'none found'}",
        f"fast blas     {st.get('action', 'not attempted')}: {st.get('reason', '')}",
        f"matmul        {_fmt(b.get('matmul_gflops'), '.1f')} GFLOP/s "
        f"(1024x1024 float32, CPU; max error vs numpy {_fmt(b.get('matmul_max_abs_error'), '.1e')})",
        "plugins       "
        + (
            ", ".join(f"{p['name']} ({p['distribution']} {p['version']})" for p in r["plugins"])
            or "none"
        ),
    ]
    if r["plugin_failures"]:
        lines.append(
            "failed        "
            + "; ".join(
                f"{f['entry_point']} ({f['distribution']} {f['version']}): {f['error']}"
                for f in r["plugin_failures"]
            )
        )
    for a in r["advice"]:
        lines.append(f"advice        {a}")
    return "\n".join(lines)


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.json:
        _print_json(report)
    else:
        print(_format_doctor(report), flush=True)
    return EXIT_OK


# -- the parser ----------------------------------------------------------------

# -- bench (specdec.bench) ------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench.command import cmd_bench as run

    return run(args)


def _add_bench(sub: Any) -> None:
    from .bench.command import add_bench_parser

    add_bench_parser(sub, func=cmd_bench)


#: Subcommands, in --help order.
SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_generate,
    _add_bench,
    _add_plugins,
    _add_doctor,
)


def build_parser() -> argparse.ArgumentParser:
    import specdec

    parser = _Parser(
        prog=PROG,
        description="Plugin-based speculative decoding for MLX.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {specdec.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for add in SUBCOMMANDS:
        add(sub)
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
        if _debug():
            traceback.print_exc()
        _err(str(exc))
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stdout.flush()
        _err("interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
