"""The hook implementation that adds ``specdec serve`` (the entry point's target)."""

from __future__ import annotations

import argparse
import math

import specdec.hookspecs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def _size(text: str) -> int:
    """A byte count: an integer, optionally with a K, M or G suffix (powers of 1024)."""
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if scale > 1 else t
    try:
        n = float(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 2G, 512M or 1000000, got {text!r}"
        ) from None
    if not math.isfinite(n) or n < 0:
        raise argparse.ArgumentTypeError(f"a byte count must be a finite number >= 0, got {text!r}")
    return int(n * scale)


@specdec.hookspecs.hookimpl
def specdec_register_commands(subparsers):
    """Add ``specdec serve``."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API, speculating with a policy",
        description=(
            "Serve one model over an OpenAI-compatible API (/v1/chat/completions, "
            "/v1/completions, /v1/models; streaming with server-sent events), with /health, "
            "/metrics (Prometheus) and a page at / to try it. Concurrent requests are decoded "
            "together (continuous batching, up to --max-batch rows per policy, each row "
            "speculating on its own) with the policy they name (a 'policy' field in the "
            "body) or the first --policy."
        ),
    )
    p.add_argument(
        "--model", default=None, help="model folder or Hub id (default: the built-in default model)"
    )
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="a policy the server offers: a preset or a .toml file; repeatable, the first is "
        "the default (default: none). Requests may also name any preset",
    )
    p.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default: {DEFAULT_HOST})"
    )
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    p.add_argument(
        "--model-name",
        default=None,
        help="the model id clients name (default: the model folder's name)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="requests decoded together, per policy (default: 8); policies whose "
        "components cannot run rows of a batch run each request alone, taking turns",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=_size,
        default=None,
        help="bound on the keys and values the prefix cache keeps across requests, in bytes "
        "or with a K/M/G suffix (default: 2G; 0 turns prefix reuse off). A request whose "
        "prompt starts with tokens an earlier request held prefills only the rest",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=None,
        help="bound on the request caches the prefix cache keeps (default: 10)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=_size,
        default=None,
        help="the largest request body the server reads, in bytes or with a K/M/G suffix; "
        "a larger one gets a 413 (default: 32M)",
    )
    p.add_argument(
        "--profile-context",
        type=int,
        default=None,
        help="profile the policies' verify cost to this many tokens of context before "
        "serving (once per machine, cached), so that no request waits for it "
        "(default: 4096, capped at the model's context; 0: only the default contexts)",
    )
    p.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(func=cmd_serve)
    from .bench import add_parser

    add_parser(subparsers)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``specdec serve`` until interrupted."""
    import sys

    if not 0 < args.port < 65536:
        print(f"specdec serve: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    for flag, value, low in (
        ("--max-batch", args.max_batch, 1),
        ("--profile-context", args.profile_context, 0),
        ("--prompt-cache-size", args.prompt_cache_size, 1),
        ("--max-body-bytes", args.max_body_bytes, 1),
    ):
        if value is not None and value < low:
            print(f"specdec serve: error: {flag} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    policies = args.policy or ["none"]
    try:
        for spec in policies:  # every policy checked before the model is loaded
            specdec.load_policy(spec)
    except specdec.SpecdecError as exc:
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import DEFAULT_MAX_BODY_BYTES, make_app
    from .engine import DEFAULT_MAX_BATCH, DEFAULT_PROFILE_CONTEXT, Engine
    from .prefix import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES

    print(
        f"specdec serve: loading {args.model or 'the default model'} ...",
        file=sys.stderr,
        flush=True,
    )
    try:
        engine = Engine(
            args.model,
            policies,
            model_name=args.model_name,
            max_batch=args.max_batch or DEFAULT_MAX_BATCH,
            prompt_cache_bytes=DEFAULT_MAX_BYTES
            if args.prompt_cache_bytes is None
            else args.prompt_cache_bytes,
            prompt_cache_size=args.prompt_cache_size or DEFAULT_MAX_ENTRIES,
            profile_context=DEFAULT_PROFILE_CONTEXT
            if args.profile_context is None
            else args.profile_context,
        )
    except specdec.SpecdecError as exc:
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"specdec serve: {engine.model_name} on http://{args.host}:{args.port} "
        f"(policies: {', '.join(engine.policy_specs)}; default {engine.default_policy}; "
        f"up to {engine.max_batch} requests decoded together per policy)",
        file=sys.stderr,
        flush=True,
    )
    if engine.prefix is None:
        print("specdec serve: prefix reuse is off (--prompt-cache-bytes 0)", file=sys.stderr)
    else:
        print(
            f"specdec serve: prefix cache: up to {engine.prefix.max_entries} request caches, "
            f"{engine.prefix.max_bytes / (1 << 20):.0f} MiB",
            file=sys.stderr,
        )
    for name, why in engine.unbatched.items():
        print(f"specdec serve: policy {name!r} runs one request at a time: {why}", file=sys.stderr)
    try:
        limit = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
        app = make_app(engine, limit)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
