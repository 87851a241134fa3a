"""Whose a trained draft head is: the target identity a head's checkpoint records, and the
check a drafter runs before it drafts with that head.

A training command (``specdec train-head``, ``specdec train-assistant``; the training
itself is the ``specdec-train`` distribution's) writes :func:`target_identity` of the
model it trained for under :data:`TARGET_FIELD` in the head's ``config.json``; a drafter
that loads the head compares it with the model it drafts for through
:func:`identity_mismatch`, and refuses a head trained for another model. Drafters need
only this module, not the training code::

    from specdec.checkpoints import TARGET_FIELD, identity_mismatch

    trained_for = config.get(TARGET_FIELD)
    if isinstance(trained_for, dict) and identity_mismatch(trained_for, model):
        ...  # trained for another model
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["TARGET_FIELD", "identity_mismatch", "target_identity", "text_model"]

#: The config key under which a trained head records the target it was trained for.
TARGET_FIELD = "specdec_target"


def text_model(model: Any) -> Any:
    """The language model of ``model`` (its ``language_model`` for a wrapper, else itself)."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and hasattr(inner, "model") else model


def target_identity(model: Any) -> dict:
    """What identifies a target for a trained head: architecture, sizes, and a hash of
    its embedding table (a head reads those embeddings and the target's hidden states).

    The hash covers up to ~4k strided rows (the scales of a quantized table), also
    rounded to bfloat16 and float16 (``embed_sha256_bf16`` / ``embed_sha256_f16``), so
    the same model cast to another precision is still recognised.
    """
    lm = text_model(model)
    emb = lm.model.embed_tokens
    w = emb.weight if not hasattr(emb, "scales") else emb.scales
    rows = w[:: max(1, w.shape[0] // 4096)]  # up to ~4k rows: cheap for any vocabulary
    h = hashlib.sha256(np.asarray(rows.astype(mx.float32)).tobytes()).hexdigest()[:24]
    rounded = {
        name: hashlib.sha256(np.asarray(rows.astype(dt).astype(mx.float32)).tobytes()).hexdigest()[
            :24
        ]
        for name, dt in (("embed_sha256_bf16", mx.bfloat16), ("embed_sha256_f16", mx.float16))
    }
    args = lm.args
    return {
        "model_type": getattr(model, "model_type", None),
        "hidden_size": int(args.hidden_size),
        "vocab_size": int(args.vocab_size),
        "num_hidden_layers": int(args.num_hidden_layers),
        "embed_sha256": h,
        **rounded,
    }


def identity_mismatch(trained_for: Mapping, model: Any) -> dict:
    """``{field: (trained for, this model)}`` for each field of ``trained_for`` (a
    :func:`target_identity`) that ``model`` does not match; empty for the same model.
    The embedding hashes count as one: any of them matching (the same table in another
    precision) is a match."""
    mine = target_identity(model)
    diff = sorted(k for k, v in trained_for.items() if mine.get(k) != v)
    hashes = [k for k in trained_for if k.startswith("embed_sha256")]
    if any(mine.get(k) == trained_for[k] for k in hashes):
        diff = [k for k in diff if not k.startswith("embed_sha256")]
    return {k: (trained_for[k], mine.get(k)) for k in diff}
