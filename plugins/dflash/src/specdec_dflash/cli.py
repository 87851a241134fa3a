"""``specdec train-dflash``: self-distil a DFlash drafter for any mlx-lm model (added to
the ``specdec`` command through the ``specdec_register_commands`` hook).

The data (the model's own answers), checkpoints, resuming and the summary are
specdec-train's :func:`specdec_train.run_training`, shared with ``train-head`` and
``train-assistant``; the loop is :func:`specdec_dflash.train.train_dflash` (blocks, not
one-token heads)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import specdec.checkpoints
import specdec_train

#: Default blocks per sequence per step.
ANCHORS = 32
#: The config key of a trained drafter's recipe (``anchors``, ``gamma``, ``init``).
RECIPE_FIELD = "specdec_train_dflash"


def add_train_dflash_parser(sub: Any) -> None:
    """Add ``train-dflash`` to the ``specdec`` command's subparsers."""
    p = sub.add_parser(
        "train-dflash",
        help="train a DFlash block drafter for a model on its own answers (for dflash)",
        description=(
            "Self-distil a DFlash drafter for MODEL: from the outputs of some of the "
            "target's layers over the context and a block [last token, MASK, ...] it learns "
            "the target's distribution over every token of the block, in one forward, the "
            "way the dflash drafter drafts. The model answers the shipped prompts (or "
            "--prompts, --text windows), and those answers are the training text; a tenth "
            "of the prompts is held out to measure the greedy acceptance per block "
            "position. The target stays frozen; the drafter shares its embeddings and "
            "output layer. The drafter goes to --out in the published DFlash layout "
            "(config.json with dflash_config and the target's identity, "
            "model.safetensors), saved every --save-every steps; --resume continues."
        ),
    )
    specdec_train.add_training_arguments(p, lr=1e-3)
    p.add_argument("--layers", type=int, default=None, help="draft layers (default: 1)")
    p.add_argument(
        "--target-layers",
        default=None,
        help="the target layers whose outputs condition the drafter, 0-based, comma-"
        "separated (default: 3 spread from layer 1 to the third-last, the published rule)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per block: the last committed token and block-size - 1 drafts (default: 8)",
    )
    p.add_argument(
        "--mask-token",
        type=int,
        default=None,
        help="the token id whose embedding fills the block after its first slot "
        "(default: the vocabulary's last id)",
    )
    p.add_argument(
        "--anchors",
        type=int,
        default=None,
        help=f"blocks per sequence per step (default: {ANCHORS})",
    )
    p.add_argument(
        "--gamma",
        type=float,
        default=None,
        help="the decay of the slot weights exp(-(k-1)/gamma) (default: the published "
        "recipe's: 7 for blocks of 16, 5 for 10, 4 for 8 and below)",
    )
    p.add_argument(
        "--init",
        choices=("target", "random"),
        default=None,
        help="target: the draft layers start as copies of the target's last layers, the "
        "final norm as the target's, fc passing the last target layer's features "
        "through; random: from scratch, as the published recipe (default: target)",
    )
    p.set_defaults(func=cmd_train_dflash)


def _ids(spec: str) -> list[int]:
    try:
        ids = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise specdec_train.TrainError(
            f"--target-layers {spec!r}: give 0-based layer indices, comma-separated"
        ) from None
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise specdec_train.TrainError(
            f"--target-layers {spec!r}: give distinct 0-based layer indices, comma-separated"
        )
    return ids


def gamma_for(block: int) -> float:
    """The published recipe's slot-weight decay for a block size."""
    return 7.0 if block >= 16 else 5.0 if block >= 10 else 4.0


def _check(args: argparse.Namespace) -> None:
    for flag, v, lo in (
        ("--layers", args.layers, 1),
        ("--block-size", args.block_size, 2),
        ("--mask-token", args.mask_token, 0),
        ("--anchors", args.anchors, 1),
    ):
        if v is not None and v < lo:
            raise specdec_train.TrainError(f"{flag} must be >= {lo}, got {v}")
    if args.gamma is not None and not args.gamma > 0:
        raise specdec_train.TrainError(f"--gamma must be > 0, got {args.gamma}")
    if args.target_layers is not None:
        _ids(args.target_layers)
    if args.resume:
        _check_resume(args)


def _check_resume(args: argparse.Namespace) -> None:
    """A resumed run's shape and recipe come from its checkpoint: a flag that says
    otherwise is refused before the model loads, the others are filled in."""
    from pathlib import Path

    path = Path(args.out).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text())
        d = cfg["dflash_config"]
        have = {
            "--layers": ("layers", cfg["num_hidden_layers"]),
            "--block-size": ("block_size", cfg["block_size"]),
            "--mask-token": ("mask_token", d["mask_token_id"]),
            "--target-layers": ("target_layers", list(d["target_layer_ids"])),
            **{
                f"--{k}": (k, v)
                for k, v in (cfg.get(RECIPE_FIELD) or {}).items()
                if k in ("anchors", "gamma", "init")
            },
        }
    except (OSError, ValueError, KeyError, TypeError):
        return  # no drafter saved there: run_training says what is missing
    for flag, (attr, saved) in have.items():
        given = getattr(args, attr)
        if attr == "target_layers" and given is not None:
            given = _ids(given)
        if given is not None and given != saved:
            raise specdec_train.TrainError(
                f"--resume: the drafter in {str(args.out)!r} has {flag} "
                f"{saved if not isinstance(saved, list) else ','.join(map(str, saved))}; it "
                "comes from the checkpoint (give that or leave it out)"
            )
        if attr != "target_layers":
            setattr(args, attr, saved)


def _make_trainer(model: Any, args: argparse.Namespace, resume: Any) -> Any:
    from .checkpoint import load_dflash, target_shape
    from .model import default_layer_ids
    from .train import DFlashTrainer, new_dflash

    _, n_target, vocab = target_shape(model)
    if resume is not None:
        module, _ = load_dflash(resume, model)  # its shape was checked in _check_resume
    else:
        ids = (
            _ids(args.target_layers)
            if args.target_layers is not None
            else default_layer_ids(n_target, 3)
            if n_target >= 5
            else [n_target // 2]
        )
        past = [i for i in ids if i >= n_target]
        if past:
            raise specdec_train.TrainError(
                f"--target-layers {past} are past the model's layers (0 .. {n_target - 1})"
            )
        mask = args.mask_token if args.mask_token is not None else (vocab or 1) - 1
        if vocab is not None and mask >= vocab:
            raise specdec_train.TrainError(
                f"--mask-token {mask} is outside the vocabulary (0 .. {vocab - 1})"
            )
        module = new_dflash(
            model,
            layers=args.layers or 1,
            block_size=args.block_size or 8,
            target_layer_ids=ids,
            mask_token_id=mask,
            seed=args.seed,
            init=args.init or "target",
        )
    gamma = args.gamma if args.gamma is not None else gamma_for(module.config.block_size)
    return DFlashTrainer(module, model, gamma=gamma, anchors=args.anchors or ANCHORS)


def cmd_train_dflash(args: argparse.Namespace) -> int:
    """Run ``specdec train-dflash``."""
    _check(args)  # before the model is loaded

    def save(out: Any, model: Any, module: Any, identity: dict) -> None:
        from .train import save_dflash

        recipe = {
            "anchors": args.anchors or ANCHORS,
            "gamma": args.gamma if args.gamma is not None else gamma_for(module.config.block_size),
            "init": args.init or "target",
        }
        save_dflash(
            out,
            module,
            extra_config={specdec.checkpoints.TARGET_FIELD: identity, RECIPE_FIELD: recipe},
        )

    def usage(out: Any) -> str:
        return (
            "use it with a policy file:\n"
            '  drafters = ["dflash"]\n  verifier = "hidden"\n\n'
            f"  [options.dflash]\n  path = {json.dumps(str(out))}\n\n"
            'or copy where the context has a match: policy "copy-dflash" with the same '
            "[options.dflash]"
        )

    from .train import train_dflash

    command = specdec_train.TrainCommand(
        name="train-dflash",
        make_trainer=_make_trainer,
        save=save,
        usage=usage,
        train=train_dflash,
    )
    return specdec_train.run_training(args, command)
