"""The hook implementation that registers ``gemma4_mtp`` (the entry point's target)."""

from __future__ import annotations

import specdec
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
        needs={"hidden", "kv"},
        supports_batch=True,
    )


@specdec.hookspecs.hookimpl
def specdec_register_policies(register):
    """Register the ``gemma4`` and ``copy-gemma4`` presets."""
    from .drafter import NAME

    # A Gemma 4 assistant (its option `assistant` names the checkpoint), which reads the
    # target's hidden state and K/V; copy-gemma4 copies where the context has a match
    # (specdec-plugin-ngram, governed by specdec-plugin-copy-governor) and uses the
    # assistant otherwise.
    register(
        "gemma4",
        specdec.Policy(name="gemma4", drafters=(NAME,), verifier="hidden"),
        description="a Gemma 4 assistant drafts",
    )
    register(
        "copy-gemma4",
        specdec.Policy(
            name="copy-gemma4",
            drafters=("ngram_copy", NAME),
            verifier="hidden",
            governor="copy_governor",
            options={"copy_governor": {"suspend_after": 5}},
        ),
        description="ngram_copy where the context has a match, else the Gemma 4 assistant",
    )


@specdec.hookspecs.hookimpl
def specdec_register_commands(subparsers):
    """Add ``specdec train-assistant``."""
    from .cli import add_train_assistant_parser

    add_train_assistant_parser(subparsers)
