"""The hook implementation that registers ``gemma4_mtp`` (the entry point's target)."""

from __future__ import annotations

import specdec.hookspecs


@specdec.hookspecs.hookimpl
def specdec_register_drafters(register):
    """Register the ``gemma4_mtp`` drafter (a Gemma 4 assistant)."""
    from .drafter import NAME, create_gemma4_mtp

    register(
        NAME,
        create_gemma4_mtp,
        description=(
            "Drafts with a Gemma 4 assistant (gemma4_assistant checkpoint) that reads the "
            "target's last hidden state and its K/V (options: assistant, depth, max_depth, "
            "position, centroids)."
        ),
    )


@specdec.hookspecs.hookimpl
def specdec_register_commands(subparsers):
    """Add ``specdec train-assistant``."""
    from .cli import add_train_assistant_parser

    add_train_assistant_parser(subparsers)
