"""``specdec train-head``: give a model an MTP head (added to the ``specdec`` command
through the ``specdec_register_commands`` hook). The data, the training loop, the
checkpoints and resuming are specdec-train's (:func:`specdec_train.run_training`, shared
with ``specdec train-assistant``); this is what is particular to the MTP head."""

from __future__ import annotations

import argparse
import json
from typing import Any

import specdec.checkpoints
import specdec_train

#: Bad ``train-head`` input (the message names it and what would be accepted).
TrainHeadError = specdec_train.TrainError

# The names train-head had before its command line moved to the core (0.3.3): kept.
DATA_FILE = specdec_train.DATA_FILE
STATE_FILE = specdec_train.STATE_FILE
SUMMARY_FILE = specdec_train.SUMMARY_FILE
shipped_prompts = specdec_train.shipped_prompts


def add_train_head_parser(sub: Any) -> None:
    """Add ``train-head`` to the ``specdec`` command's subparsers."""
    p = sub.add_parser(
        "train-head",
        help="train an MTP head for a model on its own answers (for the qwen_mtp drafter)",
        description=(
            "Self-distil a multi-token-prediction head for MODEL: from the target's hidden "
            "state at t and the token at t+1 it learns the target's distribution over the "
            "token at t+2, the way qwen_mtp drafts with it. The model answers the shipped "
            "prompts (or --prompts, --text windows), and those answers are the training "
            "text; a tenth is held out to measure how often the head's first draft would "
            "be accepted. The target stays frozen. The head goes to --out as a checkpoint "
            "in the Hugging Face layout (mtp.* tensors, config.json with the target's "
            "identity), saved every --save-every steps; --resume continues from there."
        ),
    )
    specdec_train.add_training_arguments(p, lr=1e-3)
    p.add_argument("--layers", type=int, default=1, help="MTP decoder layers (default: 1)")
    p.set_defaults(func=cmd_train_head)


def _make_trainer(model: Any, args: argparse.Namespace, resume: Any) -> Any:
    import mlx.core as mx

    from .mtp import load_mtp
    from .train import MTPTrainer

    init = None
    if resume is not None:
        init, _ = load_mtp(model, resume, dtype=mx.float32)  # trained on in float32
    return MTPTrainer(init, model, args.layers, args.seed)


def _save(out: Any, model: Any, module: Any, identity: dict) -> None:
    from .checkpoint import save_hf_checkpoint

    save_hf_checkpoint(
        out, model, module, trunk=False, extra_config={specdec.checkpoints.TARGET_FIELD: identity}
    )


def _usage(out: Any) -> str:
    return (
        "use it with a policy file:\n"
        '  drafters = ["qwen_mtp"]\n  verifier = "hidden"\n\n'
        f"  [options.qwen_mtp]\n  mtp_path = {json.dumps(str(out))}"
    )


COMMAND = specdec_train.TrainCommand(
    name="train-head", make_trainer=_make_trainer, save=_save, usage=_usage
)


def cmd_train_head(args: argparse.Namespace) -> int:
    """Run ``specdec train-head``."""
    if args.layers < 1:  # before the model is loaded
        raise TrainHeadError(f"--layers must be >= 1, got {args.layers}")
    return specdec_train.run_training(args, COMMAND)
