"""Self-distilling a DFlash drafter on the target's own text: the block loss.

The recipe is SpecForge's (``specforge/core/dflash.py``, aligned with the DFlash paper)
with ModelOpt's self-distillation loss (``hf_dflash.py``), see ``docs/notes/dflash.md``:

- **Blocks.** Anchors ``p`` drawn uniformly, without replacement, among the positions of
  a sequence with ``p + 1 <= S - 1`` (at least one token to predict); the block is
  ``[x[p], MASK x (B - 1)]`` at positions ``p .. p + B - 1``; it sees the context
  features of positions **before** ``p`` (the anchor's own features do not exist when
  drafting) and itself (no causal mask), never another block.
- **Loss.** Slot ``k >= 1`` is scored against the target's distribution at ``p + k - 1``
  (its next-token distribution for ``x[p + k]``): soft cross-entropy (KL up to a
  constant), weighted by ``exp(-(k - 1) / gamma)``, a weighted mean over the slots whose
  token is in the sequence.

Everything the target computed comes from one forward per sequence
(:func:`sequence_record`): the chosen layers' outputs and its logits. The target stays
frozen; the drafter's embeddings and output layer are the target's.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx_lm.models.cache import make_prompt_cache
from specdec.heads import output_layer
from specdec.verifiers import HiddenStateVerifier

from .drafter import embeddings
from .model import DFlashModel

__all__ = ["block_loss", "sequence_record", "train_blocks"]


def sequence_record(target: Any, seq: Sequence[int], layer_ids: Sequence[int]) -> tuple:
    """The target's context features ``[S, k * H]`` (the outputs of ``layer_ids``,
    concatenated) and its logits ``[S, V]`` over ``seq``, from one forward."""
    v = HiddenStateVerifier(layers=list(layer_ids))
    v.bind(target, layers=tuple(layer_ids))
    vr = v.verify(target, mx.array(list(seq)), make_prompt_cache(target))
    feats = mx.concatenate([vr.layers[i] for i in layer_ids], axis=-1)
    mx.eval(feats, vr.logits)
    return mx.stop_gradient(feats), mx.stop_gradient(vr.logits)


def block_loss(
    module: DFlashModel,
    embed: Callable[[mx.array], mx.array],
    logits_of: Callable[[mx.array], mx.array],
    features: mx.array,
    tokens: mx.array,
    teacher: mx.array,
    anchors: Sequence[int],
    *,
    gamma: float = 4.0,
) -> tuple[mx.array, mx.array]:
    """The weighted soft cross-entropy of one sequence's blocks, and their slots' top-1
    agreement with the target (``[B - 1]``, for the held-out figures).

    Args:
        module: the drafter.
        embed: the target's token embedding.
        logits_of: the target's output layer (hidden ``[..., H]`` -> ``[..., V]``).
        features: the target's context features ``[S, k * H]``.
        tokens: the sequence ``[S]``.
        teacher: the target's logits ``[S, V]``.
        anchors: block starts, each ``<= S - 2``.
        gamma: the decay of the slot weights.
    """
    c = module.config
    B, S = c.block_size, int(tokens.shape[0])
    p = mx.array(list(anchors))
    n = len(anchors)
    contexts = module.context(features[None], 0)  # every layer's K/V of 0 .. S-1
    slots = mx.arange(B)
    block_ids = mx.where(slots[None] == 0, tokens[p][:, None], c.mask_token_id)  # [N, B]
    # each block sees the context before its anchor and the whole of itself
    ctx_ok = mx.arange(S)[None] < p[:, None]  # [N, S]
    mask = mx.concatenate([ctx_ok, mx.ones((n, B), dtype=mx.bool_)], axis=1)
    mask = mx.broadcast_to(mask[:, None, None, :], (n, 1, B, S + B))
    hidden = module.forward(embed(block_ids), p, contexts, mask)  # [N, B, H]
    pos = p[:, None] + slots[None, 1:]  # the token each slot predicts: [N, B-1]
    valid = (pos < S).astype(mx.float32)
    at = mx.minimum(pos - 1, S - 1)
    teach = teacher[at]  # [N, B-1, V]: the target's distribution for x[pos]
    draft = logits_of(hidden[:, 1:])
    ce = -mx.sum(mx.softmax(teach, axis=-1) * nn.log_softmax(draft, axis=-1), axis=-1)
    w = mx.exp(-(slots[1:].astype(mx.float32) - 1) / gamma)[None] * valid
    loss = mx.sum(ce * w) / mx.maximum(mx.sum(w), 1e-9)
    agree = (mx.argmax(draft, axis=-1) == mx.argmax(teach, axis=-1)).astype(mx.float32) * valid
    return loss, mx.sum(agree, axis=0) / mx.maximum(mx.sum(valid, axis=0), 1.0)


def train_blocks(
    module: DFlashModel,
    target: Any,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int,
    lr: float = 6e-4,
    anchors_per_sequence: int = 32,
    gamma: float = 4.0,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``module`` on ``sequences`` (the target's own text) for ``steps`` steps of
    one sequence each (AdamW, warm-up then cosine); returns the losses."""
    from mlx.utils import tree_flatten

    c = module.config
    embed = embeddings(target)
    out = output_layer(target).logits  # the target's own output path
    rng = random.Random(seed)
    records = [sequence_record(target, s, c.target_layer_ids) for s in sequences]
    warm = max(1, steps // 25)
    schedule = optim.join_schedules(
        [optim.linear_schedule(lr / 10, lr, warm), optim.cosine_decay(lr, max(1, steps - warm))],
        [warm],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.0)

    def loss_fn(m: DFlashModel, feats, toks, teach, anchors):
        return block_loss(m, embed, out, feats, toks, teach, anchors, gamma=gamma)[0]

    grad = nn.value_and_grad(module, loss_fn)
    losses = []
    for step in range(steps):
        i = rng.randrange(len(sequences))
        seq = list(sequences[i])
        feats, teach = records[i]
        usable = list(range(0, len(seq) - 1))
        if not usable:
            continue
        anchors = sorted(rng.sample(usable, min(anchors_per_sequence, len(usable))))
        loss, grads = grad(module, feats, mx.array(seq), teach, anchors)
        flat = tree_flatten(grads)
        norm = math.sqrt(sum(float(mx.sum(g * g)) for _, g in flat)) if flat else 0.0
        if norm > 1.0:  # clip at 1.0
            grads = _scale(grads, 1.0 / norm)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state)
        losses.append(float(loss))
        if on_step is not None:
            on_step(step, losses[-1])
    return losses


def _scale(tree: Any, f: float) -> Any:
    from mlx.utils import tree_map

    return tree_map(lambda g: g * f, tree)
