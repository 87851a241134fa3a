"""Helpers for drafters that step a model or a head ``k`` times.

:func:`draft_lazily` is the draft loop the model-head drafters share (``draft_model``
in the core, ``qwen_mtp``, ``gemma4_mtp``): each step's logits give the next token,
drawn greedily or from the request's sampler with the draft stream's position keys,
and nothing is read back to the host: the block and its ``q`` stay lazy arrays that
the core feeds to the verify forward (the one host sync of the round reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from .roles import Draft
from .sampling import STREAM_DRAFT

__all__ = ["draft_lazily"]


def draft_lazily(
    k: int,
    step: Callable[[int, Any], mx.array],
    sampler: Any,
    position: int,
    *,
    greedy: bool,
) -> Draft:
    """Draft ``k`` tokens, one model (or head) step each, without a host sync.

    Args:
        k: tokens to draft (>= 1).
        step: ``step(i, previous)`` returns the logits ``[1, vocab]`` of draft position
            ``i``; ``previous`` is the token drawn at step ``i - 1`` (a lazy ``[1]``
            array), ``None`` at step 0. The drafter's own state (its cache, its hidden
            state) advances inside ``step``.
        sampler: the request's :class:`specdec.Sampler`.
        position: the absolute position of the first drafted token (``len(history)``):
            the key of draft token ``i`` is the draft stream's key at ``position + i``.
        greedy: draw the argmax (a deterministic draft, ``probs`` ``None``); otherwise
            sample, and ``probs`` holds each position's ``q`` (after the sampler's filters).

    Returns:
        a :class:`specdec.Draft` whose ``tokens`` (and ``probs``) are lazy arrays.
    """
    tokens, qs = [], []
    y = None
    for i in range(k):
        logits = step(i, y)
        if greedy:
            y = mx.argmax(logits, axis=-1)
        else:
            qs.append(sampler.probs(logits)[0])
            y = sampler.sample_lazy(logits, position + i, STREAM_DRAFT)
        tokens.append(y)
        mx.async_eval(y)
    return Draft(tokens=mx.concatenate(tokens), probs=mx.stack(qs) if qs else None)
