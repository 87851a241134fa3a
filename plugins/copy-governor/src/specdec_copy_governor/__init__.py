"""specdec-plugin-copy-governor: the ``copy_governor`` governor for specdec.

Keeps cheap drafters (such as ``ngram_copy``) from costing time when their
blocks are not accepted: an acceptance EMA, probation with small blocks, and
suspension with a doubling backoff. It governs any drafter, by name::

    import specdec
    pol = specdec.Policy(drafters=("ngram_copy",), governor="copy_governor")
"""

from __future__ import annotations

from .governor import (
    DEFAULTS,
    CopyGovernor,
    CopyGovernorSession,
    DrafterState,
    create_copy_governor,
)

__version__ = "0.4.1"

__all__ = [
    "DEFAULTS",
    "CopyGovernor",
    "CopyGovernorSession",
    "DrafterState",
    "create_copy_governor",
]
