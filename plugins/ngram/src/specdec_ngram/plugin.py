"""The hook implementation that registers ``ngram_copy`` (the entry point's target)."""

from __future__ import annotations

import specdec.hookspecs

from .drafter import NAME, create_ngram_copy


@specdec.hookspecs.hookimpl
def specdec_register_drafters(register):
    """Register the ``ngram_copy`` drafter."""
    register(
        NAME,
        create_ngram_copy,
        description=(
            "Copies blocks from the context: proposes what followed the longest, most "
            "recent earlier occurrence of the last tokens (options: source, min_n, max_n, "
            "ladder, max_block)."
        ),
    )
