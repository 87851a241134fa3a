"""specdec-plugin-gemma4-mtp: the Gemma 4 assistant drafter (``gemma4_mtp``).

Gemma 4 models ship a small assistant (``model_type: gemma4_assistant``) that drafts
from the target's own last hidden state and attends to the target's K/V instead of
keeping a cache of its own::

    import specdec
    pipe = specdec.assemble("path/to/gemma-4-E2B-it", policy=specdec.load_policy(
        "gemma4").with_options("gemma4_mtp", assistant="path/to/gemma-4-E2B-it-assistant"))

:func:`train_assistant` trains a Gemma-4-style assistant for any mlx-lm model (through
specdec-train's :mod:`specdec_train`).
"""

from __future__ import annotations

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

from .assistant import (
    MODEL_TYPE,
    AssistantConfig,
    AssistantLoadError,
    Gemma4Assistant,
    MaskedEmbedder,
)
from .checkpoint import load_assistant, read_config, save_assistant
from .drafter import DEFAULTS, NAME, Gemma4MTPDrafter, create_gemma4_mtp
from .target import TargetBinding, bind_target
from .train import AssistantTrainer, cluster_vocabulary, new_assistant, train_assistant

__version__ = "0.3.0"

__all__ = [
    "DEFAULTS",
    "MODEL_TYPE",
    "NAME",
    "AssistantConfig",
    "AssistantLoadError",
    "AssistantTrainer",
    "Gemma4Assistant",
    "Gemma4MTPDrafter",
    "MaskedEmbedder",
    "TargetBinding",
    "bind_target",
    "cluster_vocabulary",
    "create_gemma4_mtp",
    "load_assistant",
    "new_assistant",
    "read_config",
    "save_assistant",
    "train_assistant",
]
