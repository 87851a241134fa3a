"""Shared fixture: tiny assistants trained on their tiny targets' own text, written as
Hugging Face ``gemma4_assistant`` checkpoints (no downloads)."""

from __future__ import annotations

import pytest
import specdec
import specdec.checkpoints
from gemma4_support import ASSISTANTS, TARGETS, target
from specdec.testing import greedy_sequences
from specdec_gemma4_mtp import new_assistant, save_assistant, train_assistant


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """``trained(target, kind) -> (model, checkpoint folder, sequences, summary)``: an
    assistant trained for a few seconds on the tiny target's own text, saved in the
    Hugging Face layout (sharded for the masked one) with its target's identity."""
    cache = {}

    def get(name: str = "gemma4", kind: str = "dense"):
        key = (name, kind)
        if key not in cache:
            model = target(name)
            seqs = greedy_sequences(model)
            opts = dict(ASSISTANTS[kind])
            if TARGETS[name][0] == "llama":
                opts["layers"] = ["full_attention"]
            init, _ = new_assistant(model, **opts)
            module, st = train_assistant(model, seqs, init=init, steps=150)
            assert st["last_loss"] < st["first_loss"] / 3 and st["top1"] > 0.8, st
            folder = save_assistant(
                tmp_path_factory.mktemp(f"{name}-{kind}"),
                module,
                shards=2 if kind == "centroids" else 1,
                extra_config={
                    specdec.checkpoints.TARGET_FIELD: specdec.checkpoints.target_identity(model)
                },
            )
            cache[key] = (model, folder, seqs, st)
        return cache[key]

    return get
