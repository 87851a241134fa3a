"""The hook implementation that registers ``coarse_head`` (the entry point's target)."""

from __future__ import annotations

import specdec.hookspecs

from .head import NAME, create_coarse_head


@specdec.hookspecs.hookimpl
def specdec_register_draft_heads(register):
    """Register the ``coarse_head`` draft head."""
    register(
        NAME,
        create_coarse_head,
        description=(
            "A coarse output head (a low-bit copy, or float rows of the frequent and context "
            "tokens) ranks the vocabulary; the real head's rows rescore the best candidates "
            "exactly (options: kind, candidates, bits, keep, corpus)."
        ),
    )
