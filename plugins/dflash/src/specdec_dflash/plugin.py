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
    )
