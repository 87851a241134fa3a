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

from . import distributed, options
from .batch import Batch, BatchEvent, BatchKVRollback
from .capture import ModelTaps, TapError, model_taps
from .costs import (
    AcceptanceEstimate,
    BlockChoice,
    CostModel,
    RoundOverhead,
    VerifyCostCurve,
    best_block,
    profile_verify_cost,
)
from .depth import AdaptiveDepth
from .distributed import DistributedError
from .errors import (
    ModelLoadError,
    PluginConflictError,
    PolicyError,
    RequestError,
    SpecdecError,
    UnknownComponentError,
)
from .heads import ExactHead, OutputLayer, model_vocab_size, output_layer
from .hookspecs import hookimpl
from .kvview import KVView, kv_view, kv_views
from .loading import model_source, set_model_source
from .paths import cache_dir
from .pipeline import GenerationResult, Pipeline, StreamResponse, assemble
from .plugins import get_plugin_host, get_plugin_manager, reset_plugin_host
from .policy import DEFAULT_POLICY, PRESETS, Policy, default_policy, load_policy
from .progress import Progress
from .roles import (
    CAPABILITIES,
    ROLES,
    Acceptance,
    Acceptor,
    BaseDrafter,
    BaseDrafterSession,
    BaseGovernor,
    BaseGovernorSession,
    CacheRollback,
    Draft,
    Drafter,
    DrafterSession,
    DraftHead,
    Governor,
    GovernorSession,
    LayerTransaction,
    PrefillChunk,
    RequestContext,
    RoundResult,
    Verifier,
    VerifyResult,
)
from .rollback import (
    KVTrimRollback,
    RollbackPlan,
    RollbackUnavailable,
    RotatingWindowRollback,
    rollback_plan,
)
from .sampling import STREAM_DRAFT, Sampler, validate_request
from .shadow import ShadowScore
from .stats import Stats
from .verifiers import HiddenStateVerifier, LogitsVerifier

__version__ = "0.2.16"

__all__ = [
    "CAPABILITIES",
    "ROLES",
    "Acceptance",
    "AcceptanceEstimate",
    "AdaptiveDepth",
    "Acceptor",
    "BaseDrafter",
    "Batch",
    "BatchEvent",
    "BatchKVRollback",
    "BaseDrafterSession",
    "BaseGovernor",
    "BaseGovernorSession",
    "BlockChoice",
    "CacheRollback",
    "CostModel",
    "Draft",
    "DraftHead",
    "Drafter",
    "DrafterSession",
    "ExactHead",
    "GenerationResult",
    "Governor",
    "GovernorSession",
    "HiddenStateVerifier",
    "KVTrimRollback",
    "KVView",
    "LayerTransaction",
    "LogitsVerifier",
    "ModelTaps",
    "OutputLayer",
    "PrefillChunk",
    "RollbackPlan",
    "RollbackUnavailable",
    "RotatingWindowRollback",
    "TapError",
    "DistributedError",
    "ModelLoadError",
    "DEFAULT_POLICY",
    "PRESETS",
    "Pipeline",
    "PluginConflictError",
    "Policy",
    "PolicyError",
    "Progress",
    "RequestContext",
    "RequestError",
    "RoundResult",
    "STREAM_DRAFT",
    "Sampler",
    "ShadowScore",
    "SpecdecError",
    "Stats",
    "StreamResponse",
    "UnknownComponentError",
    "Verifier",
    "VerifyCostCurve",
    "VerifyResult",
    "assemble",
    "best_block",
    "cache_dir",
    "default_policy",
    "get_plugin_host",
    "get_plugin_manager",
    "hookimpl",
    "kv_view",
    "kv_views",
    "load_policy",
    "model_source",
    "model_taps",
    "model_vocab_size",
    "distributed",
    "options",
    "output_layer",
    "profile_verify_cost",
    "reset_plugin_host",
    "rollback_plan",
    "set_model_source",
    "validate_request",
    "RoundOverhead",
]
