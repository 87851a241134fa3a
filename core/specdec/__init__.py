"""specdec: plugin-based speculative decoding for MLX.

Public API::

    import specdec
    pipe = specdec.assemble("path/to/model", policy="copy")
    for r in pipe.stream("prompt", max_tokens=256):
        print(r.text, end="")
    out = pipe.generate("prompt", max_tokens=256)
    out.text, out.tokens, out.stats

The top level holds what users and plugin authors need most: building and running a
pipeline, the roles and the records passed between them, the errors, and a few
helpers. The rest lives in documented submodules: ``specdec.costs`` (the cost model),
``specdec.options`` (option declarations), ``specdec.drafting`` (the lazy draft loop),
``specdec.rollback``, ``specdec.heads``, ``specdec.kvview``, ``specdec.capture``,
``specdec.depth``, ``specdec.shadow``, ``specdec.sampling``, ``specdec.policy``,
``specdec.plugins``, ``specdec.verifiers``, ``specdec.distributed`` (not loaded by
``import specdec``), ``specdec.testing`` (the test kit). See docs/writing-plugins.md,
"From 0.2", for where each 0.2 top-level name went.
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

# The documented submodules (light; not training, the bench or distributed).
from . import (
    capture,
    checkpoints,
    costs,
    depth,
    drafting,
    heads,
    kvview,
    loading,
    options,
    paths,
    presets,
    progress,
    roles,
    rollback,
    sampling,
    shadow,
    verifiers,
)
from .assembly import assemble
from .batch import Batch, BatchEvent, CacheSnapshot
from .errors import (
    ComponentError,
    DistributedError,
    DraftError,
    ModelLoadError,
    PluginConflictError,
    PolicyError,
    RequestError,
    SpecdecError,
    UnknownComponentError,
)
from .hookspecs import hookimpl
from .pipeline import GenerationResult, Pipeline, StreamResponse
from .plugins import get_plugin_host, rollback_plan
from .policy import Policy
from .presets import default_policy, load_policy
from .request import Request
from .roles import (
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
from .sampling import Sampler
from .stats import Stats

__version__ = "0.3.7"

__all__ = [
    # building and running a pipeline
    "Batch",
    "BatchEvent",
    "CacheSnapshot",
    "GenerationResult",
    "Pipeline",
    "Policy",
    "Request",
    "Stats",
    "StreamResponse",
    "assemble",
    "default_policy",
    "load_policy",
    # the roles
    "Acceptor",
    "BaseDrafter",
    "BaseDrafterSession",
    "BaseGovernor",
    "BaseGovernorSession",
    "CacheRollback",
    "DraftHead",
    "Drafter",
    "DrafterSession",
    "Governor",
    "GovernorSession",
    "LayerTransaction",
    "Verifier",
    # the records passed between them
    "Acceptance",
    "Draft",
    "PrefillChunk",
    "RequestContext",
    "RoundResult",
    "VerifyResult",
    # what a plugin needs besides
    "Sampler",
    "get_plugin_host",
    "hookimpl",
    "rollback_plan",
    # errors
    "ComponentError",
    "DistributedError",
    "DraftError",
    "ModelLoadError",
    "PluginConflictError",
    "PolicyError",
    "RequestError",
    "SpecdecError",
    "UnknownComponentError",
]

#: The 0.2 top-level names that moved to a submodule in 0.3: name -> submodule. They
#: still resolve (with a DeprecationWarning) until 0.4.
MOVED = {
    **dict.fromkeys(
        (
            "AcceptanceEstimate",
            "BlockChoice",
            "CostModel",
            "RoundOverhead",
            "VerifyCostCurve",
            "best_block",
            "profile_verify_cost",
        ),
        "costs",
    ),
    "AdaptiveDepth": "depth",
    **dict.fromkeys(
        (
            "BatchKVRollback",
            "KVTrimRollback",
            "RollbackPlan",
            "RollbackUnavailable",
            "RotatingWindowRollback",
        ),
        "rollback",
    ),
    "CAPABILITIES": "roles",
    "ROLES": "roles",
    "DEFAULT_POLICY": "presets",
    "PRESETS": "presets",
    **dict.fromkeys(("ExactHead", "OutputLayer", "model_vocab_size", "output_layer"), "heads"),
    "HiddenStateVerifier": "verifiers",
    "LogitsVerifier": "verifiers",
    **dict.fromkeys(("KVView", "kv_view", "kv_views"), "kvview"),
    **dict.fromkeys(("ModelTaps", "TapError", "model_taps"), "capture"),
    "Progress": "progress",
    "STREAM_DRAFT": "sampling",
    "validate_request": "sampling",
    "ShadowScore": "shadow",
    "cache_dir": "paths",
    "get_plugin_manager": "plugins",
    "reset_plugin_host": "plugins",
    "model_source": "loading",
    "set_model_source": "loading",
}

#: Submodules that ``import specdec`` does not load, loaded on first attribute access.
_LAZY = ("distributed",)


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name in MOVED:
        import warnings

        where = f"specdec.{MOVED[name]}"
        warnings.warn(
            f"specdec.{name} moved to {where}.{name} in specdec-core 0.3 (the old name goes "
            "in 0.4)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(where), name)
    if name == "training":
        raise AttributeError(
            "specdec.training left specdec-core in 0.3: self-distillation is the "
            "specdec-train distribution (pip install specdec-train; import specdec_train)"
        )
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
