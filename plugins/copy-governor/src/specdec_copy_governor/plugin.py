"""The hook implementation that registers ``copy_governor`` (the entry point's target)."""

from __future__ import annotations

import specdec.hookspecs

from .governor import NAME, create_copy_governor


@specdec.hookspecs.hookimpl
def specdec_register_governors(register):
    """Register the ``copy_governor`` governor."""
    register(
        NAME,
        create_copy_governor,
        description=(
            "Acceptance EMA, probation with capped blocks, and suspension with a doubling "
            "backoff, per drafter (governs any drafter)."
        ),
        supports_batch=True,
    )
