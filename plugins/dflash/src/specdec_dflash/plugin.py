"""The hook implementation that registers ``dflash`` (the entry point's target)."""

from __future__ import annotations

import specdec
import specdec.hookspecs

from .drafter import NAME


@specdec.hookspecs.hookimpl
def specdec_register_drafters(register):
    """Register the ``dflash`` drafter (block diffusion from the target's hidden states)."""
    from .drafter import create_dflash

    register(
        NAME,
        create_dflash,
        description=(
            "Drafts a whole block in one forward of a DFlash model conditioned on the "
            "target's hidden states (options: path, max_draft, head, sizing)."
        ),
        needs={"layer_hidden"},
        # each row's session drafts its own block from its own context cache (fed from
        # its prefill and its rows of the batch's verify results)
        supports_batch=True,
    )


@specdec.hookspecs.hookimpl
def specdec_register_policies(register):
    """Register the ``dflash`` and ``copy-dflash`` presets (option ``path`` names the
    drafter: ``[options.dflash] path = ...`` in a policy file)."""
    register(
        "dflash",
        specdec.Policy(name="dflash", drafters=(NAME,), verifier="hidden"),
        description="a DFlash drafter drafts a block per forward (options.dflash.path)",
    )
    # copy first where the context has a match (specdec-plugin-ngram, governed by
    # specdec-plugin-copy-governor), the DFlash drafter otherwise
    register(
        "copy-dflash",
        specdec.Policy(
            name="copy-dflash",
            drafters=("ngram_copy", NAME),
            verifier="hidden",
            governor="copy_governor",
            options={"copy_governor": {"suspend_after": 5}},
        ),
        description="ngram_copy where the context has a match, else the DFlash drafter",
    )


@specdec.hookspecs.hookimpl
def specdec_register_commands(subparsers):
    """Add ``specdec train-dflash``."""
    from .cli import add_train_dflash_parser

    add_train_dflash_parser(subparsers)
