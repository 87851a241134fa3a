"""specdec-plugin-dflash: the ``dflash`` drafter (block-diffusion drafting, DFlash).

A DFlash model proposes a whole block of tokens in one forward, conditioned on the
outputs of some of the target's decoder layers. See the plugin's README.
"""

from __future__ import annotations

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

from .checkpoint import DFlashLoadError, load_dflash, read_config
from .drafter import NAME, DFlashDrafter, DFlashSession, create_dflash
from .model import DFlashConfig, DFlashModel, default_layer_ids

__version__ = "0.1.0"

__all__ = [
    "NAME",
    "DFlashConfig",
    "DFlashDrafter",
    "DFlashLoadError",
    "DFlashModel",
    "DFlashSession",
    "create_dflash",
    "default_layer_ids",
    "load_dflash",
    "read_config",
]
