"""``specdec plugins`` and ``specdec doctor``: what is installed and what specdec runs on."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any

from .. import blas
from ..options import parse_value
from .common import EXIT_OK, CliError, fmt, print_json

__all__ = [
    "add_doctor_parser",
    "add_plugins_parser",
    "cmd_doctor",
    "cmd_plugins",
    "doctor_report",
    "format_doctor",
    "format_plugins",
]


def add_plugins_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plugins",
        help="list installed plugins, their components and load failures",
        description="List installed specdec plugins, their components and load failures.",
    )
    p.add_argument("--all", action="store_true", help="include the built-in components")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plugins)


def format_plugins(info: dict, *, include_builtins: bool) -> str:
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
        print_json(info)
    else:
        print(format_plugins(info, include_builtins=args.all), flush=True)
    return EXIT_OK


# -- doctor --------------------------------------------------------------------


def add_doctor_parser(sub: Any) -> None:
    p = sub.add_parser(
        "doctor",
        help="versions, device, BLAS in use, matmul speed, verify attention, plugins",
        description="Report what specdec runs on: versions, device, BLAS and its speed, the attention verify forwards use, plugins.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--model",
        metavar="MODEL",
        help="also print MODEL's verify cost curve on this device (what a verify forward of "
        "k tokens costs at each profiled context length, relative to one decode step): read "
        "from specdec's cache, or profiled once and cached; 'default' is the built-in model",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="with --model: profile the curve again, replacing the cached one",
    )
    p.add_argument(
        "--head",
        action="append",
        default=None,
        metavar="NAME[:OPTION=VALUE,...]",
        help="with --model: build draft head NAME for MODEL (with these options, e.g. "
        "coarse_head:kind=auto,keep=16384) and print what it reports (for coarse_head: "
        "what it chose and the timings behind the choice, extra memory, build time); "
        "repeatable",
    )
    p.set_defaults(func=cmd_doctor)


def fmt_value(v: Any) -> str:
    """A stats value on one line (dicts and lists as compact JSON)."""
    import json

    if isinstance(v, (dict, list, tuple)):
        return json.dumps(v, separators=(", ", ": "), default=str)
    return str(v)


def parse_head_spec(spec: str) -> tuple[str, dict]:
    """``NAME[:OPTION=VALUE,...]`` -> ``(name, options)``.

    Raises:
        CliError: an option without ``=``.
    """
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise CliError(
                f"--head {spec!r}: {part!r} is not OPTION=VALUE "
                "(write NAME or NAME:OPTION=VALUE,OPTION=VALUE)"
            )
        options[key.strip()] = parse_value(value)
    if not name.strip():
        raise CliError(f"--head {spec!r}: no head name (write NAME[:OPTION=VALUE,...])")
    return name.strip(), options


def head_report(model: Any, tokenizer: Any, specs: list[str]) -> list[dict]:
    """Build each draft head of ``specs`` for ``model`` and collect its ``stats()``.

    Raises:
        CliError: a malformed spec; PolicyError: an unknown head or bad options.
    """
    import specdec

    host = specdec.get_plugin_host()
    parsed = [parse_head_spec(s) for s in specs]
    for name, _ in parsed:  # every name checked before any head is built
        host.get("draft_head", name)
    out = []
    for name, options in parsed:
        head = host.draft_head(name, options, model, tokenizer)
        stats = head.stats() if hasattr(head, "stats") else {}
        out.append({"head": name, "options": options, "stats": stats})
    return out


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
    from specdec.attention import status as attention_status

    att = attention_status()
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
        "verify_attention": {
            "replica": att.enabled,
            "reason": att.reason,
            "speedup": att.speedup,
            "description": att.describe(),
        },
        "plugins": [
            {"name": p["name"], "distribution": p["distribution"], "version": p["version"]}
            for p in host_info["plugins"]
        ],
        "plugin_failures": host_info["failures"],
        "advice": advice,
    }


def format_doctor(r: dict) -> str:
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
        f"matmul        {fmt(b.get('matmul_gflops'), '.1f')} GFLOP/s "
        f"(1024x1024 float32, CPU; max error vs numpy {fmt(b.get('matmul_max_abs_error'), '.1e')})",
        f"attention     verify forwards use {r['verify_attention']['description']}",
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


def _load_doctor_model(model_spec: str) -> tuple[str, Any, Any]:
    from specdec.loading import check_model_path, load_model

    from .common import check_model_spec, default_model

    if model_spec == "default":
        path = default_model()
    else:
        path = check_model_spec(model_spec, "--model")
    check_model_path(path)
    model, tokenizer = load_model(path)
    return path, model, tokenizer


def verify_cost_report(
    model_spec: str, *, reprofile: bool = False, loaded: tuple | None = None
) -> dict:
    """The verify cost curve of ``model_spec`` on this device, as ``specdec doctor --model`` shows it.

    ``loaded``: ``(path, model, tokenizer)`` already loaded for ``model_spec``."""
    import specdec
    from specdec.costs import CostModel

    path, model, _ = loaded or _load_doctor_model(model_spec)
    cm = CostModel(model, specdec.verifiers.LogitsVerifier())
    if reprofile:
        CostModel._memory.pop(cm._fingerprint, None)
        cm.persist_read = False
    curve = cm.curve()
    return {
        "model": str(path),
        "source": cm.source,
        "path": str(cm.path),
        "device": curve.device,
        "curve": curve.to_dict(),
        "table": curve.table(),
    }


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.reprofile and not args.model:
        raise CliError("--reprofile needs --model")
    if args.head and not args.model:
        raise CliError("--head needs --model (the model to build the head for)")
    if args.head:  # unknown heads and bad options fail before any model work
        import specdec

        host = specdec.get_plugin_host()
        for spec in args.head:
            name, options = parse_head_spec(spec)
            host.get("draft_head", name)
            host.create("draft_head", name, options)  # checks the options; binds nothing
    report = doctor_report()
    if args.model:
        loaded = _load_doctor_model(args.model)
        report["verify_cost"] = verify_cost_report(
            args.model, reprofile=args.reprofile, loaded=loaded
        )
        if args.head:
            report["heads"] = head_report(loaded[1], loaded[2], args.head)
    if args.json:
        print_json(report)
        return EXIT_OK
    print(format_doctor(report), flush=True)
    vc = report.get("verify_cost")
    if vc:
        print(
            f"\nverify cost of {vc['model']} on {vc['device']} ({vc['source']}; {vc['path']}):\n"
            "each column is a verify forward of that many tokens (the last token plus k "
            "drafted), relative to one decode step at the same context\n" + vc["table"],
            flush=True,
        )
    for h in report.get("heads", ()):
        opts = ", ".join(f"{k}={v}" for k, v in h["options"].items()) or "defaults"
        lines = [f"\ndraft head {h['head']} ({opts}) for {vc['model']}:"]
        lines += [f"  {k}: {fmt_value(v)}" for k, v in h["stats"].items()]
        print("\n".join(lines), flush=True)
    return EXIT_OK
