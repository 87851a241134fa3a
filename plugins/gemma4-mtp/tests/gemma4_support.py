"""Tiny Gemma 4 targets and assistants for the tests (no downloads)."""

from __future__ import annotations

import specdec
from specdec.testing import make_tiny_model

#: Tiny targets: Gemma 4 text (sliding window 8 that wraps within a test, two KV-shared
#: layers, per-layer inputs, soft-capped logits), its K-eq-V variant (full-attention
#: values from the key projection), and a llama (one layer type, no sharing).
TARGETS = {
    "gemma4": ("gemma4", {}),
    "gemma4-k-eq-v": ("gemma4", {"attention_k_eq_v": True, "num_global_key_value_heads": 1}),
    "llama": ("llama", {}),
}

#: Tiny assistants: a dense head reading both layer types, and a centroid-masked one
#: (8 clusters of 8 tokens, 2 scored per step) of another width.
ASSISTANTS = {
    "dense": dict(layers=["sliding_attention", "full_attention"]),
    "centroids": dict(
        layers=["sliding_attention", "full_attention"],
        hidden_size=32,
        centroids=8,
        top_k_centroids=2,
    ),
}


def target(name: str):
    arch, kw = TARGETS[name]
    return make_tiny_model(arch, **kw)


def policy(folder, preset: str = "gemma4", **options):
    """The preset with the assistant (and other ``gemma4_mtp`` options) set."""
    return specdec.load_policy(preset).with_options("gemma4_mtp", assistant=str(folder), **options)
