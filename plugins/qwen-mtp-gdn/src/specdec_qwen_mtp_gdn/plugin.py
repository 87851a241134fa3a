"""The hook implementation that registers ``gdn_transaction`` (the entry point's target)."""

from __future__ import annotations

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
