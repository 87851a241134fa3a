"""Helpers the plugin's tests import: tiny hybrid models and copy-heavy prompts (no downloads).

A module name of its own, not ``conftest``: several test folders are collected together.
"""

from __future__ import annotations

import functools

import specdec
from specdec.testing import find_copy_prompt
from specdec_qwen_mtp_gdn.tiny import make_tiny_draft, make_tiny_hybrid

#: The two architectures the pipeline tests run on (qwen3_5_moe shares qwen3_5's GDN layer).
ARCHS = ("qwen3_next", "qwen3_5")
#: ngram_copy sizing its blocks by its ladder (a block on every match): on these tiny
#: models a forward costs about the loop's host work, so which blocks the cost sizing
#: finds paying depends on the machine's timing — a verify curve profiled while other
#: work ran once priced every block out, and a test that needs drafts drafted none.
NGRAM = specdec.Policy(
    name="ngram", drafters=("ngram_copy",), options={"ngram_copy": {"sizing": "ladder"}}
)


def copy_model(arch):
    """A tiny hybrid that falls into loops of its own (mixing 0.2): copy drafts get accepted."""
    return make_tiny_hybrid(arch, mixing=0.2, seed=0)


def draft_for(arch):
    """The all-attention twin of :func:`copy_model` (shares its embeddings, MLPs and head)."""
    return make_tiny_draft(copy_model(arch))


@functools.cache
def copy_prompt(arch, min_accepted=6):
    """A prompt (seed, the model's continuation, the seed again) on which ``ngram_copy``
    gets ``min_accepted`` drafts accepted in 32 greedy tokens, from a deterministic search."""
    return tuple(find_copy_prompt(copy_model(arch), NGRAM, min_accepted=min_accepted))
