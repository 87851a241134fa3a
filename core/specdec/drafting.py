"""Helpers for drafters that step a model or a head ``k`` times.

:func:`draft_lazily` is the draft loop the model-head drafters share (``draft_model``
in the core, ``qwen_mtp``, ``gemma4_mtp``): each step's logits give the next token,
drawn greedily or from the request's sampler with the draft stream's position keys,
and nothing is read back to the host: the block and its ``q`` stay lazy arrays that
the core feeds to the verify forward (the one host sync of the round reads them).
:func:`draw` is one such draw, for drafters that step several rows of a batch at once;
:class:`BatchRows` keeps a drafter's own caches as one batch cache whose rows join and
leave with the batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .roles import Draft
from .sampling import STREAM_DRAFT

__all__ = ["BatchRows", "draft_lazily", "draw"]


def draw(
    logits: mx.array, sampler: Any, position: int, *, greedy: bool
) -> tuple[mx.array, mx.array | None]:
    """One draft token from one row's logits ``[1, vocab]``, lazily: the argmax when
    ``greedy`` (``q`` is ``None``), else drawn from ``sampler`` with the draft stream's
    key at ``position`` (``q``: the sampler's distribution ``[vocab]``, after its filters).

    Returns:
        ``(token, q)``: ``token`` a lazy ``(1,)`` array of token ids.
    """
    if greedy:
        return mx.argmax(logits, axis=-1), None
    return sampler.sample_lazy(logits, position, STREAM_DRAFT), sampler.probs(logits)[0]


class BatchRows:
    """A drafter's own per-layer caches for the rows of a :class:`specdec.Batch`, as mlx-lm
    batch caches (one row per request, in join order), named by the rows' ids.

    ``add_row`` merges a row's own caches (prefilled alone) in (mlx-lm's ``merge`` and
    ``extend``), ``drop_rows`` filters rows out (``filter``). A
    :class:`specdec.roles.DrafterBatch` may subclass it and call them from its ``join``
    and ``leave``.
    """

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.caches: list | None = None

    def add_row(self, row: int, caches: list) -> None:
        """Append ``row``, whose own (single-request) caches are ``caches``."""
        merged = [type(c).merge([c]) for c in caches]
        mx.eval([c.state for c in merged])
        if self.caches is None:
            self.caches = merged
        else:
            for c, o in zip(self.caches, merged):
                c.extend(o)
        self.rows.append(row)

    def drop_rows(self, rows: Sequence[int]) -> list[int]:
        """Drop ``rows`` (ids not held are ignored); returns the ids dropped."""
        wanted = set(rows)
        gone = [r for r in self.rows if r in wanted]
        keep = [i for i, r in enumerate(self.rows) if r not in gone]
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.caches = None
        elif gone and self.caches is not None:
            for c in self.caches:
                c.filter(keep)
        return gone


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
        y, q = draw(step(i, y), sampler, position + i, greedy=greedy)
        if q is not None:
            qs.append(q)
        tokens.append(y)
        mx.async_eval(y)
    return Draft(tokens=mx.concatenate(tokens), probs=mx.stack(qs) if qs else None)
