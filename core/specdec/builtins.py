"""specdec's built-in components, registered through the same hooks as any plugin."""

from __future__ import annotations

from .hookspecs import hookimpl


@hookimpl
def specdec_register_drafters(register):
    """Register ``draft_model``."""
    from .drafters.draft_model import DraftModelDrafter

    register(
        "draft_model",
        DraftModelDrafter,
        description="a smaller mlx-lm model with the target's tokenizer drafts autoregressively",
    )


@hookimpl
def specdec_register_verifiers(register):
    """Register ``logits`` and ``hidden``."""
    from .verifiers import HiddenStateVerifier, LogitsVerifier

    register("logits", LogitsVerifier, description="one target forward, logits per position")
    register("hidden", HiddenStateVerifier, description="logits plus last hidden states")


@hookimpl
def specdec_register_acceptors(register):
    """Register ``greedy``, ``point_mass`` and ``rejection``."""
    from .acceptors import GreedyAcceptor, PointMassAcceptor, RejectionAcceptor

    register(
        "greedy", GreedyAcceptor, description="exact prefix of the target's argmax (temperature 0)"
    )
    register(
        "point_mass",
        PointMassAcceptor,
        description="deterministic drafts under sampling, residual correction, position-keyed",
    )
    register(
        "rejection",
        RejectionAcceptor,
        description="Leviathan rejection sampling with draft probabilities q",
    )


@hookimpl
def specdec_register_cache_rollbacks(register):
    """Register ``kv_trim``, ``rotating_window``, ``cache_list``, ``batch_kv`` and
    ``batch_rotating``."""
    from .rollback import (
        BatchKVRollback,
        BatchRotatingRollback,
        CacheListRollback,
        KVTrimRollback,
        RotatingWindowRollback,
    )

    register(
        "kv_trim", KVTrimRollback, description="KVCache / QuantizedKVCache: trim the rejected tail"
    )
    register(
        "rotating_window",
        RotatingWindowRollback,
        description="RotatingKVCache, exact also after the window wrapped",
    )
    register("cache_list", CacheListRollback, description="CacheList: delegate each child")
    register(
        "batch_kv",
        BatchKVRollback,
        description="BatchKVCache: rows of a batch rolled back by different amounts",
    )
    register(
        "batch_rotating",
        BatchRotatingRollback,
        description="BatchRotatingKVCache: sliding-window rows of a batch rolled back per row",
    )


@hookimpl
def specdec_register_draft_heads(register):
    """Register ``exact``."""
    from .heads import ExactHead

    register(
        "exact",
        ExactHead,
        description="the target's own output layer, through the model's own output path",
    )


@hookimpl
def specdec_register_governors(register):
    """No built-in governor (``copy_governor`` is a plugin); the hook is implemented for symmetry."""


@hookimpl
def specdec_register_policies(register):
    """Register the core's presets, ``none``, ``draft`` and ``forced`` (plugins register the rest)."""
    register("none", {"name": "none"}, description="plain decoding through the same loop")
    register(
        "draft",
        {"name": "draft", "drafters": ["draft_model"]},
        description="the draft_model drafter alone (option model)",
    )
    register(
        "forced",
        {"name": "forced", "forced_drafts": True},
        description="no drafter: a constrained request drafts its grammar's forced tokens",
    )
