"""specdec-plugin-qwen-mtp-gdn: speculative decoding for hybrid gated-delta-net models.

Registers the ``gdn_transaction`` cache rollback, which makes the conv and
recurrent state of the gated-delta-net layers of mlx-lm's ``qwen3_next``,
``qwen3_5`` and ``qwen3_5_moe`` models roll back exactly, so every drafter
(``ngram_copy``, ``draft_model``, ...) works on them. Installed, it is picked
automatically for those layers; attention layers keep the core's ``kv_trim``::

    import specdec
    pipe = specdec.assemble(model, policy="copy")
    out = pipe.generate(prompt)
    out.stats.rollbacks          # ['gdn_transaction:capture', 'kv_trim']

Choose a strategy through the policy options::

    specdec.Policy(drafters=("ngram_copy",), rollback="gdn_transaction",
                   options={"gdn_transaction": {"strategy": "tape"}})
"""

from __future__ import annotations

from .costs import CommitCost, measure_commit_cost
from .recording import CaptureError
from .rollback import (
    NAME,
    STRATEGIES,
    GatedDeltaRollback,
    GatedDeltaTransaction,
    default_strategy,
)
from .tiny import HYBRID_ARCHITECTURES, make_tiny_hybrid, tiny_hybrid_config

__version__ = "0.2.0"

__all__ = [
    "HYBRID_ARCHITECTURES",
    "NAME",
    "STRATEGIES",
    "CaptureError",
    "CommitCost",
    "GatedDeltaRollback",
    "GatedDeltaTransaction",
    "default_strategy",
    "make_tiny_hybrid",
    "measure_commit_cost",
    "tiny_hybrid_config",
]
