"""specdec-plugin-coarse-head: the ``coarse_head`` draft head for specdec.

A draft step of an MTP head or a small draft model spends most of its time in
the output layer. ``coarse_head`` ranks the vocabulary with a cheap copy of it
and rescores the best ``candidates`` tokens with the real layer's rows, so a
greedy draft is the real head's argmax whenever that token is among the
candidates, and a sampled draft comes with its exact ``q``. Name it in a
drafter's ``head`` option::

    import specdec
    pol = specdec.Policy(
        drafters=("qwen_mtp",), verifier="hidden",
        options={"qwen_mtp": {"head": "coarse_head"}, "coarse_head": {"kind": "auto"}},
    )
"""

from __future__ import annotations

from .head import DEFAULTS, KINDS, CoarseHead, create_coarse_head

__version__ = "0.2.0"

__all__ = ["DEFAULTS", "KINDS", "CoarseHead", "create_coarse_head"]
