"""The hook implementation that registers ``gdn_transaction`` (the entry point's target)."""

from __future__ import annotations

import specdec
import specdec.hookspecs

from .rollback import NAME, GatedDeltaRollback


@specdec.hookspecs.hookimpl
def specdec_register_cache_rollbacks(register):
    """Register the ``gdn_transaction`` cache rollback."""
    register(
        NAME,
        GatedDeltaRollback,
        description=(
            "Exact speculative transactions for gated-delta-net state (Qwen3-Next, Qwen3.5): "
            "commit keeps the accepted prefix of conv and recurrent state "
            "(option: strategy = auto | capture | tape | rerun)."
        ),
    )


@specdec.hookspecs.hookimpl
def specdec_register_drafters(register):
    """Register the ``qwen_mtp`` drafter (the model's own MTP head)."""
    from .mtp_drafter import NAME as MTP_NAME
    from .mtp_drafter import create_qwen_mtp

    register(
        MTP_NAME,
        create_qwen_mtp,
        description=(
            "Drafts with the native MTP head of Qwen3-Next / Qwen3.5, read from the original "
            "checkpoint (options: mtp_path, depth, max_depth, adaptive, head)."
        ),
        needs={"hidden"},
        supports_batch=True,
    )


@specdec.hookspecs.hookimpl
def specdec_register_policies(register):
    """Register the ``mtp`` and ``copy-mtp`` presets."""
    from .mtp_drafter import NAME as MTP_NAME

    # The model's own MTP head, which reads the target's hidden states; copy-mtp copies
    # where the context has a match (specdec-plugin-ngram, governed by
    # specdec-plugin-copy-governor) and uses the head otherwise.
    register(
        "mtp",
        specdec.Policy(name="mtp", drafters=(MTP_NAME,), verifier="hidden"),
        description="the model's own MTP head drafts",
    )
    register(
        "copy-mtp",
        specdec.Policy(
            name="copy-mtp",
            drafters=("ngram_copy", MTP_NAME),
            verifier="hidden",
            governor="copy_governor",
            options={"copy_governor": {"suspend_after": 5}},
        ),
        description="ngram_copy where the context has a match, else the MTP head",
    )


@specdec.hookspecs.hookimpl
def specdec_register_commands(subparsers):
    """Add ``specdec train-head``."""
    from .cli import add_train_head_parser

    add_train_head_parser(subparsers)
