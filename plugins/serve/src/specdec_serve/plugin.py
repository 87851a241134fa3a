"""The hook implementation that adds ``specdec serve`` (the entry point's target)."""

from __future__ import annotations

import argparse

import specdec.hookspecs

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


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
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``specdec serve`` until interrupted."""
    import sys

    if not 0 < args.port < 65536:
        print(f"specdec serve: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    if args.max_batch is not None and args.max_batch < 1:
        print(
            f"specdec serve: error: --max-batch must be >= 1, got {args.max_batch}",
            file=sys.stderr,
        )
        return 2
    policies = args.policy or ["none"]
    try:
        for spec in policies:  # every policy checked before the model is loaded
            specdec.load_policy(spec)
    except specdec.SpecdecError as exc:
        print(f"specdec serve: error: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from .app import make_app
    from .engine import DEFAULT_MAX_BATCH, Engine

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
    for name, why in engine.unbatched.items():
        print(f"specdec serve: policy {name!r} runs one request at a time: {why}", file=sys.stderr)
    try:
        uvicorn.run(make_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
