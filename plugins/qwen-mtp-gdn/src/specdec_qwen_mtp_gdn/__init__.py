"""specdec-plugin-qwen-mtp-gdn: speculative decoding for hybrid gated-delta-net models,
and their native MTP heads as drafters.

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

It also registers the ``qwen_mtp`` drafter (the model's own MTP head, read from the
original checkpoint; presets ``mtp`` and ``copy-mtp``) and adds ``specdec train-head``,
which self-distils such a head for any model::

    pipe = specdec.assemble(model, policy=specdec.load_policy("mtp").with_options(
        "qwen_mtp", mtp_path="path/to/original/checkpoint"))
"""

from __future__ import annotations

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

from .checkpoint import save_hf_checkpoint
from .costs import CommitCost, measure_commit_cost
from .mtp import MTPLoadError, QwenMTP, load_mtp, read_mtp_weights
from .mtp_drafter import AdaptiveDepth, QwenMTPDrafter, create_qwen_mtp
from .recording import CaptureError
from .rollback import (
    NAME,
    STRATEGIES,
    GatedDeltaRollback,
    GatedDeltaTransaction,
    default_strategy,
)
from .tiny import HYBRID_ARCHITECTURES, make_tiny_hybrid, tiny_hybrid_config
from .train import train_mtp_head

__version__ = "0.5.0"

__all__ = [
    "HYBRID_ARCHITECTURES",
    "MTPLoadError",
    "AdaptiveDepth",
    "QwenMTP",
    "QwenMTPDrafter",
    "create_qwen_mtp",
    "load_mtp",
    "read_mtp_weights",
    "save_hf_checkpoint",
    "train_mtp_head",
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
