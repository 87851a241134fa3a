"""specdec: plugin-based speculative decoding for MLX.

Public API::

    import specdec
    pipe = specdec.assemble("path/to/model", policy="copy")
    for r in pipe.stream("prompt", max_tokens=256):
        print(r.text, end="")
    out = pipe.generate("prompt", max_tokens=256)
    out.text, out.tokens, out.stats
"""

from __future__ import annotations

# Before anything imports mlx: bind MLX's CPU matmuls to a fast BLAS when one is installed.
from . import blas as _blas

_blas_status = _blas.ensure_fast_blas()
if _blas_status.action == "too_late":
    import warnings as _warnings

    _warnings.warn(
        "specdec: mlx was imported before specdec, so MLX's CPU matmuls use mlx-cpu's "
        "reference BLAS (about 10x slower, which makes speculation pointless); import "
        "specdec before mlx or mlx_lm, or run with "
        f"LD_PRELOAD={_blas_status.library}. 'specdec doctor' shows the BLAS in use.",
        RuntimeWarning,
        stacklevel=2,
    )

from .errors import (
    ModelLoadError,
    PluginConflictError,
    PolicyError,
    RequestError,
    SpecdecError,
    UnknownComponentError,
)
from .hookspecs import hookimpl
from .pipeline import GenerationResult, Pipeline, StreamResponse, assemble
from .plugins import get_plugin_host, get_plugin_manager, reset_plugin_host
from .policy import PRESETS, Policy, load_policy
from .roles import (
    Acceptance,
    Acceptor,
    BaseDrafter,
    BaseGovernor,
    CacheRollback,
    Draft,
    Drafter,
    Governor,
    LayerTransaction,
    RequestContext,
    RoundResult,
    Verifier,
    VerifyResult,
)
from .sampling import Sampler, validate_request
from .stats import Stats

__version__ = "0.2.0"

__all__ = [
    "Acceptance",
    "Acceptor",
    "BaseDrafter",
    "BaseGovernor",
    "CacheRollback",
    "Draft",
    "Drafter",
    "GenerationResult",
    "Governor",
    "LayerTransaction",
    "ModelLoadError",
    "PRESETS",
    "Pipeline",
    "PluginConflictError",
    "Policy",
    "PolicyError",
    "RequestContext",
    "RequestError",
    "RoundResult",
    "Sampler",
    "SpecdecError",
    "Stats",
    "StreamResponse",
    "UnknownComponentError",
    "Verifier",
    "VerifyResult",
    "assemble",
    "get_plugin_host",
    "get_plugin_manager",
    "hookimpl",
    "load_policy",
    "reset_plugin_host",
    "validate_request",
]
