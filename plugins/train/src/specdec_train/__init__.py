"""specdec-train: self-distillation of draft heads, the library the head plugins'
training commands share.

A draft head (an MTP head, a Gemma 4 assistant) learns to propose what the target would
say from text the target wrote itself. What differs between heads is a
:class:`HeadTrainer`; the rest is here: recording what the target computed
(:func:`record`, :func:`batch_answers`), the training loop (:func:`train_head`),
held-out agreement (:func:`agreement`), and a training command's whole body
(:func:`add_training_arguments`, :func:`run_training` with a :class:`TrainCommand`:
the model's answers as data, checkpoints, resuming, a summary)::

    import specdec_train

    def add_my_train_parser(subparsers):
        p = subparsers.add_parser("train-my-head", help="...")
        specdec_train.add_training_arguments(p, lr=1e-3)
        p.set_defaults(func=lambda args: specdec_train.run_training(args, COMMAND))

A drafter does not need this distribution to check that a head was trained for its
target: that check is the core's :mod:`specdec.checkpoints`.
"""

from __future__ import annotations

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

from .command import (
    DATA_FILE,
    STATE_FILE,
    SUMMARY_FILE,
    TrainCommand,
    TrainError,
    add_training_arguments,
    held_out_acceptance,
    prompt_ids,
    run_training,
    shipped_prompts,
)
from .loop import LOSSES, HeadTrainer, agreement, train_head
from .recording import Recorded, TargetOutput, batch_answers, record, target_hidden

__version__ = "0.1.1"

__all__ = [
    "DATA_FILE",
    "LOSSES",
    "STATE_FILE",
    "SUMMARY_FILE",
    "HeadTrainer",
    "Recorded",
    "TargetOutput",
    "TrainCommand",
    "TrainError",
    "add_training_arguments",
    "agreement",
    "batch_answers",
    "held_out_acceptance",
    "prompt_ids",
    "record",
    "run_training",
    "shipped_prompts",
    "target_hidden",
    "train_head",
]
