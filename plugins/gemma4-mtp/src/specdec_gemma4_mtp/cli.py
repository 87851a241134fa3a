"""``specdec train-assistant``: train a Gemma-4-style assistant for any mlx-lm model
(added to the ``specdec`` command through the ``specdec_register_commands`` hook).

The data (the model's own answers), the training loop, checkpoints and resuming are the
specdec-train's :func:`specdec_train.run_training`, shared with ``specdec train-head``; this
is what is particular to the assistant: its shape and its checkpoint."""

from __future__ import annotations

import argparse
import json
from typing import Any

import specdec.checkpoints
import specdec_train

from .assistant import LAYER_TYPES

#: Written to a trained assistant's config: the RoPE position convention it learned.
POSITION_FIELD = "specdec_position"

_SHORT = {"sliding": "sliding_attention", "full": "full_attention"}


def add_train_assistant_parser(sub: Any) -> None:
    """Add ``train-assistant`` to the ``specdec`` command's subparsers."""
    p = sub.add_parser(
        "train-assistant",
        help="train a Gemma-4-style assistant for a model on its own answers (for gemma4_mtp)",
        description=(
            "Self-distil a Gemma 4 style assistant for MODEL: from the target's hidden state "
            "at t, the token at t+1 and the target's K/V up to t it learns the target's "
            "distribution over the token at t+2, the way gemma4_mtp drafts with it. The "
            "model answers the shipped prompts (or --prompts, --text windows), and those "
            "answers are the training text; a tenth is held out to measure how often the "
            "first draft would be accepted. The target stays frozen. The assistant goes to "
            "--out as a gemma4_assistant checkpoint in the Hugging Face layout (config.json "
            "with the target's identity, model.safetensors), saved every --save-every steps; "
            "--resume continues from there."
        ),
    )
    specdec_train.add_training_arguments(p, lr=1e-3)
    p.add_argument(
        "--layers",
        default=None,
        help="the assistant's layers: a count (that many layers reading the K/V of the "
        "target's last layer type) or their types, comma-separated: sliding, full "
        "(default: 1)",
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="the assistant's width (default: the target's; its tied embeddings then start "
        "as the target's)",
    )
    p.add_argument(
        "--intermediate-size", type=int, default=None, help="MLP width (default: 2 x width)"
    )
    p.add_argument("--heads", type=int, default=None, help="query heads (default: the target's)")
    p.add_argument(
        "--centroids",
        type=int,
        default=None,
        help="clusters of a centroid-masked output layer (0: the whole tied head; the "
        "vocabulary must split into them evenly) (default: 0)",
    )
    p.add_argument(
        "--top-k-centroids",
        type=int,
        default=None,
        help="clusters the masked output layer scores per step (default: 32)",
    )
    p.add_argument(
        "--position",
        choices=("bonus", "last"),
        default="bonus",
        help="the queries' RoPE position: the last token's (bonus, Hugging Face) or the "
        "last committed token's (last, vLLM / mlx-vlm) (default: bonus)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="drafts per round plus one, written to the config: the drafter's starting and "
        "least depth (default: 2, one draft; gemma4_mtp's max_depth lets it grow; Google's "
        "assistants have 4)",
    )
    p.set_defaults(func=cmd_train_assistant)


def _layers(spec: str) -> int | list[str]:
    s = spec.strip()
    if s.isdigit():
        n = int(s)
        if n < 1:
            raise specdec_train.TrainError(f"--layers must be >= 1, got {n}")
        return n
    out = []
    for part in s.split(","):
        t = _SHORT.get(part.strip(), part.strip())
        if t not in LAYER_TYPES:
            raise specdec_train.TrainError(
                f"--layers: {part.strip()!r} is no layer type; give a count or a "
                "comma-separated list of sliding, full"
            )
        out.append(t)
    return out


def _check(args: argparse.Namespace) -> None:
    if args.layers is not None:
        _layers(args.layers)
    for flag, v, lo in (
        ("--hidden-size", args.hidden_size, 1),
        ("--intermediate-size", args.intermediate_size, 1),
        ("--heads", args.heads, 1),
        ("--centroids", args.centroids, 0),
        ("--top-k-centroids", args.top_k_centroids, 1),
        ("--block-size", args.block_size, 2),
    ):
        if v is not None and v < lo:
            raise specdec_train.TrainError(f"{flag} must be >= {lo}, got {v}")
    if args.centroids and (args.top_k_centroids or 32) > args.centroids:
        raise specdec_train.TrainError(
            f"--top-k-centroids ({args.top_k_centroids or 32}) must be at most --centroids "
            f"({args.centroids})"
        )


def _make_trainer(model: Any, args: argparse.Namespace, resume: Any) -> Any:
    import mlx.core as mx

    from .checkpoint import load_assistant
    from .target import bind_target
    from .train import AssistantTrainer, new_assistant

    if resume is not None:
        module, cfg = load_assistant(resume, dtype=mx.float32)  # trained on in float32
        position = cfg.raw.get(POSITION_FIELD, args.position)
        if position != args.position:
            raise specdec_train.TrainError(
                f"--resume: the assistant in {str(resume)!r} was trained with --position "
                f"{position}; give the same --position"
            )
        layers = None if args.layers is None else _layers(args.layers)
        given = {
            "--layers": (
                len(cfg.layer_types) if isinstance(layers, int) else list(cfg.layer_types),
                layers,
            ),
            "--hidden-size": (cfg.hidden_size, args.hidden_size),
            "--intermediate-size": (cfg.intermediate_size, args.intermediate_size),
            "--heads": (cfg.num_attention_heads, args.heads),
            "--centroids": (cfg.num_centroids if cfg.use_ordered_embeddings else 0, args.centroids),
            "--block-size": (cfg.block_size, args.block_size),
        }
        if cfg.use_ordered_embeddings:
            given["--top-k-centroids"] = (cfg.centroid_intermediate_top_k, args.top_k_centroids)
        for flag, (have, want) in given.items():
            if want is not None and want != have:
                raise specdec_train.TrainError(
                    f"--resume: the assistant in {str(resume)!r} has {flag} {have}; its shape "
                    f"comes from the checkpoint (give {flag} {have} or leave it out)"
                )
        binding = bind_target(model, cfg)
    else:
        module, binding = new_assistant(
            model,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            layers=_layers(args.layers or "1"),
            heads=args.heads,
            block_size=args.block_size or 2,
            centroids=args.centroids or 0,
            top_k_centroids=args.top_k_centroids or 32,
            seed=args.seed,
        )
    trainer = AssistantTrainer(module, binding, position=args.position)
    return trainer


def cmd_train_assistant(args: argparse.Namespace) -> int:
    """Run ``specdec train-assistant``."""
    _check(args)  # before the model is loaded

    def save(out: Any, model: Any, module: Any, identity: dict) -> None:
        from .checkpoint import save_assistant

        save_assistant(
            out,
            module,
            extra_config={
                specdec.checkpoints.TARGET_FIELD: identity,
                POSITION_FIELD: args.position,
            },
        )

    def usage(out: Any) -> str:
        return (
            "use it with a policy file:\n"
            '  drafters = ["gemma4_mtp"]\n  verifier = "hidden"\n\n'
            f"  [options.gemma4_mtp]\n  assistant = {json.dumps(str(out))}"
        )

    command = specdec_train.TrainCommand(
        name="train-assistant", make_trainer=_make_trainer, save=save, usage=usage
    )
    return specdec_train.run_training(args, command)
