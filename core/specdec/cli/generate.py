"""``specdec generate``: text from a prompt, flags as ``mlx_lm.generate``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..distributed import SHARDING_KINDS
from .common import (
    EXIT_OK,
    PROG,
    CliError,
    check_model_spec,
    check_policy_components,
    default_model,
    fmt,
    print_json,
    read_prompt,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROMPT",
    "add_generate_parser",
    "build_policy",
    "cmd_generate",
    "format_stats_line",
]

#: mlx_lm.generate's defaults, except --max-tokens (256 here).
DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 256

#: The drafter that --draft-model adds and --num-draft-tokens configures.
DRAFT_MODEL = "draft_model"


def format_stats_line(stats: dict, *, policy: str = "", generated: int | None = None) -> str:
    """The one-line ``--stats`` summary."""
    parts = []
    if policy:
        parts.append(f"policy={policy}")
    n = generated if generated is not None else stats.get("generation_tokens")
    if n is not None:
        parts.append(f"{n} tokens")
    parts.append(f"prompt {fmt(stats.get('prompt_tps'), '.1f')} tok/s")
    parts.append(f"decode {fmt(stats.get('decode_tps'), '.1f')} tok/s")
    parts.append(f"{fmt(stats.get('tokens_per_forward'), '.2f')} tokens/forward")
    fwd = stats.get("target_forwards")
    if fwd is not None:
        parts.append(f"{fwd} target forwards")
    acc = stats.get("acceptance_rate")
    acc_s = "n/a" if acc is None or not stats.get("drafted") else f"{100.0 * acc:.1f}%"
    parts.append(
        f"acceptance {acc_s} ({fmt(stats.get('accepted'), 'd', '0')}/"
        f"{fmt(stats.get('drafted'), 'd', '0')})"
    )
    mem = stats.get("peak_memory_gb")
    if mem is not None:
        parts.append(f"peak {fmt(mem, '.2f')} GB")
    dist = stats.get("distributed") or {}
    if dist:
        parts.append(
            f"{dist.get('ranks')} ranks, {fmt(dist.get('collectives_per_token'), '.1f')} "
            "collectives/token"
        )
    off = stats.get("speculation_off_reason")
    if off:
        parts.append(f"speculation off: {off}")
    return f"{PROG}: " + " | ".join(parts)


def add_generate_parser(sub: Any) -> None:
    """Add the ``generate`` subcommand to ``sub`` (an argparse subparsers object)."""
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
        default="default",
        help="a preset name (none, copy, ngram, draft, ...) or a policy .toml file "
        "(default: 'default', the copy preset when specdec-plugin-ngram and "
        "specdec-plugin-copy-governor are installed, else none; none is plain decoding)",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        help="a smaller model with the same tokenizer; adds the draft_model drafter (to "
        "--policy; without --policy it drafts alone)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help=(
            "tokens the draft_model drafter drafts per round (its num_draft_tokens option; "
            "the policy's max_block is raised to at least this); needs --draft-model or a "
            "policy with draft_model"
        ),
    )
    p.add_argument(
        "--stats",
        action="store_true",
        help="print one summary line on stderr: tok/s, tokens per forward, acceptance",
    )
    p.add_argument(
        "--sharding",
        choices=SHARDING_KINDS,
        default="auto",
        help="under mlx.launch, how the model is split across the ranks: tensor parallel, "
        "pipeline parallel, or auto (tensor where the model allows it, else pipeline; "
        "default)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (text, tokens, stats) on stdout instead of streaming",
    )
    p.set_defaults(func=cmd_generate)


def build_policy(args: argparse.Namespace) -> Any:
    """The policy ``generate`` runs: ``--policy`` with ``--draft-model`` and
    ``--num-draft-tokens`` applied, every component checked to be installed."""
    import attrs

    import specdec

    policy = specdec.load_policy(args.policy, draft_model=args.draft_model is not None)
    n = args.num_draft_tokens
    if n is not None and n < 1:
        raise CliError(f"--num-draft-tokens must be >= 1, got {n}")
    if args.draft_model is not None:
        draft = check_model_spec(args.draft_model, "--draft-model")
        if DRAFT_MODEL not in policy.drafters:
            policy = attrs.evolve(
                policy,
                name=f"{policy.name}+{DRAFT_MODEL}",
                drafters=(*policy.drafters, DRAFT_MODEL),
            )
        policy = policy.with_options(DRAFT_MODEL, model=draft)
    if n is not None:
        if DRAFT_MODEL not in policy.drafters:
            raise CliError(
                f"--num-draft-tokens sets how many tokens the {DRAFT_MODEL} drafter drafts "
                f"per round, but policy {policy.name!r} has no {DRAFT_MODEL} drafter; "
                "add --draft-model PATH (or use a policy with draft_model)"
            )
        # the drafter drafts n tokens; the pipeline verifies blocks of up to max_block
        # (and none shorter than min_block), so both must let a block of n through
        policy = attrs.evolve(
            policy.with_options(DRAFT_MODEL, num_draft_tokens=n),
            max_block=max(policy.max_block, n),
            min_block=min(policy.min_block, n),
        )
    check_policy_components(policy)
    return policy


def cmd_generate(args: argparse.Namespace) -> int:
    import specdec

    sampling = dict(temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p)
    # 1. everything that can be checked without a model
    specdec.sampling.validate_request(max_tokens=args.max_tokens, **sampling)
    policy = build_policy(args)
    model = check_model_spec(args.model, "--model") if args.model else None
    prompt = read_prompt(args.prompt)
    if model is None:
        model = default_model()

    # 2. the model
    try:
        pipe = specdec.assemble(model, policy=policy, sharding=args.sharding)
    except specdec.SpecdecError:
        raise
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot load model {model!r}: {exc}") from exc

    ids = pipe.encode_prompt(
        prompt, chat_template=not args.ignore_chat_template, system_prompt=args.system_prompt
    )
    kwargs = dict(max_tokens=args.max_tokens, seed=args.seed, **sampling)
    # Under mlx.launch every rank runs the request; only rank 0 prints.
    speaks = pipe.sharding is None or pipe.sharding.rank == 0

    if args.json:
        out = pipe.generate(ids, **kwargs)
        if not speaks:
            return EXIT_OK
        stats = out.stats.to_dict() if out.stats is not None else {}
        print_json(
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
        if r.text and speaks:
            sys.stdout.write(r.text)
            sys.stdout.flush()
        if getattr(r, "stats", None) is not None:
            stats_obj = r.stats
    if not speaks:
        return EXIT_OK
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.stats:
        stats = stats_obj.to_dict() if stats_obj is not None else {}
        print(
            format_stats_line(stats, policy=policy.name, generated=n), file=sys.stderr, flush=True
        )
    return EXIT_OK
