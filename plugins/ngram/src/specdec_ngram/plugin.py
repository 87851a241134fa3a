"""The hook implementation that registers ``ngram_copy`` (the entry point's target)."""

from __future__ import annotations

import specdec
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
        supports_batch=True,
    )


@specdec.hookspecs.hookimpl
def specdec_register_policies(register):
    """Register the ``copy`` and ``ngram`` presets."""
    # ngram_copy sizes its own blocks by cost (a poor round is a small block), so the
    # governor suspends it only after five poor rounds in a row: on the bench workloads
    # three suspended it in verbatim copies, where each suspension cost two plain steps.
    # For the same reason the governor does not cap its blocks when the acceptance EMA
    # is low (shrink_below 0): on prose at temperature 0 that cap turned five-token
    # blocks into four-token ones and decoded 5.6% slower (median of six paired runs),
    # and it puts no drafter on probation (probation_rounds 0): capping a request's
    # first blocks at four tokens until two good rounds cost one forward per request on
    # the copy workloads (ngram_copy alone opens with 8- and 9-token blocks), 0.977x to
    # 0.985x of ungoverned ngram_copy at temperature 0.
    register(
        "copy",
        specdec.Policy(
            name="copy",
            drafters=(NAME,),
            governor="copy_governor",
            options={
                "copy_governor": {"suspend_after": 5, "shrink_below": 0, "probation_rounds": 0}
            },
        ),
        description="ngram_copy governed by copy_governor (specdec-plugin-copy-governor)",
    )
    register(
        "ngram", specdec.Policy(name="ngram", drafters=(NAME,)), description="ngram_copy alone"
    )
