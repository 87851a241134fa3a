"""Train an MTP head for a model on its own distribution (the target stays frozen).

The head learns ``x[t+2]`` from ``(h_t, x[t+1])`` exactly as ``qwen_mtp`` drafts with
it: ``h_t`` is the target's hidden state after its final norm and the logits come from
the target's own output path. The labels are the target's own next-token
distribution at ``t+1`` (self-distillation with soft labels: its ``soft_top_k`` most
likely tokens, renormalised), or the text's tokens with ``soft_top_k=None``. Trained on
text the target wrote itself (greedy continuations), the head learns to propose what
the target would say.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import specdec

from .mtp import QwenMTP, text_model


def target_hidden(model: Any, tokens: Sequence[int]) -> mx.array:
    """The target's hidden states ``[L, H]`` (after its final norm) for ``tokens``, one forward."""
    return _target(model, tokens)[0]


def _target(model: Any, tokens: Sequence[int]) -> tuple[mx.array, mx.array]:
    taps = specdec.model_taps(model)
    with taps.recording() as rec:
        logits = model(mx.array(list(tokens))[None])
    h = rec["hidden"][0]
    mx.eval(h, logits)
    return h, logits[0].astype(mx.float32)


class _Example:
    """One sequence's training inputs: embeddings of x[t+1], h_t, labels for x[t+2]."""

    __slots__ = ("emb", "hid", "tokens", "soft_ids", "soft_p", "target_top1")

    def __init__(self, model: Any, seq: Sequence[int], soft_top_k: int | None) -> None:
        h, logits = _target(model, seq)
        toks = mx.array(list(seq))
        self.emb = mx.stop_gradient(text_model(model).model.embed_tokens(toks[1:-1]))
        self.hid = h[:-2]
        self.tokens = toks[2:]
        nxt = logits[1:-1]  # the target's distribution over x[t+2]
        self.target_top1 = mx.argmax(nxt, axis=-1)
        if soft_top_k:
            k = min(soft_top_k, nxt.shape[-1])
            ids = mx.argpartition(-nxt, kth=k - 1, axis=-1)[..., :k]
            top = mx.take_along_axis(nxt, ids, axis=-1)
            self.soft_ids, self.soft_p = ids, mx.softmax(top, axis=-1)
        else:
            self.soft_ids = self.soft_p = None
        mx.eval(self.emb, self.hid, self.target_top1, self.soft_ids, self.soft_p)


def _logits(taps: Any, head: QwenMTP, ex: _Example) -> mx.array:
    o = head(ex.emb[None], ex.hid[None], [None] * len(head.layers))
    return taps.head(o).astype(mx.float32)[0]


def agreement(model: Any, head: QwenMTP, examples: Sequence[_Example]) -> float:
    """The fraction of positions where the head's argmax is the target's: the acceptance of
    a first greedy draft on that text (``nan`` without positions)."""
    taps = specdec.model_taps(model)
    right = total = 0
    for ex in examples:
        pred = mx.argmax(_logits(taps, head, ex), axis=-1)
        right += int((pred == ex.target_top1).sum())
        total += ex.tokens.shape[0]
    return right / total if total else float("nan")


def train_mtp_head(
    model: Any,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int = 300,
    lr: float = 3e-3,
    layers: int = 1,
    seed: int = 0,
    init: QwenMTP | None = None,
    start_step: int = 0,
    soft_top_k: int | None = None,
    held_out: Sequence[Sequence[int]] = (),
    eval_every: int = 0,
    progress: Callable[[int, int, float, float | None], None] | None = None,
    checkpoint: Callable[[int, QwenMTP], None] | None = None,
    checkpoint_every: int = 0,
) -> tuple[QwenMTP, dict]:
    """Fit a :class:`~specdec_qwen_mtp_gdn.mtp.QwenMTP` head to ``model``'s own text.

    Args:
        model: the target (frozen).
        sequences: token sequences to train on (prompt + the target's continuation);
            each needs at least 3 tokens.
        steps: the last step (Adam; each step goes over every sequence).
        lr: the learning rate.
        layers: MTP decoder layers (when no ``init`` is given).
        seed: the initialisation seed.
        init: a head to start from (a checkpoint's), trained in place.
        start_step: steps already done (resuming: training runs ``start_step+1 .. steps``).
        soft_top_k: distil the target's distribution over its ``soft_top_k`` most likely
            tokens; ``None``: the text's tokens are the labels.
        held_out: sequences never trained on, for :func:`agreement` (acceptance of the
            first draft) every ``eval_every`` steps and at the end.
        progress: ``progress(step, steps, loss, held_out_agreement_or_None)`` per step.
        checkpoint: ``checkpoint(step, head)`` every ``checkpoint_every`` steps.

    Returns:
        the head and ``{"steps", "first_loss", "last_loss", "top1", "held_out_top1"}``
        (``top1``: the agreement on the training text).

    Raises:
        ValueError: no sequence of at least 3 tokens, or ``steps <= start_step``.
    """
    seqs = [list(s) for s in sequences if len(s) >= 3]
    if not seqs:
        raise ValueError("train_mtp_head: give at least one sequence of 3 or more tokens")
    if steps < 1 or steps <= start_step:
        raise ValueError(
            f"train_mtp_head: steps must be >= 1 and above start_step ({start_step}), got {steps}"
        )
    taps = specdec.model_taps(model)
    data = [_Example(model, s, soft_top_k) for s in seqs]
    held = [_Example(model, s, None) for s in held_out if len(s) >= 3]
    mx.random.seed(seed)
    head = init if init is not None else QwenMTP(model, layers)
    head.train()
    optimizer = optim.Adam(learning_rate=lr)

    def loss_fn(m: QwenMTP) -> mx.array:
        total = mx.array(0.0)
        count = 0
        for ex in data:
            logits = _logits(taps, m, ex)
            if ex.soft_ids is None:
                total = total + nn.losses.cross_entropy(logits, ex.tokens, reduction="sum")
            else:
                logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                picked = mx.take_along_axis(logp, ex.soft_ids, axis=-1)
                total = total - (ex.soft_p * picked).sum()
            count += ex.tokens.shape[0]
        return total / count

    step_fn = nn.value_and_grad(head, loss_fn)
    first = last = None
    held_top1 = None
    for i in range(start_step, steps):
        loss, grads = step_fn(head)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, loss)
        last = float(loss)
        if first is None:
            first = last
        step = i + 1
        if held and eval_every and (step % eval_every == 0 or step == steps):
            held_top1 = agreement(model, head, held)
        if progress is not None:
            progress(step, steps, last, held_top1)
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0:
            checkpoint(step, head)
    head.eval()
    if held and held_top1 is None:
        held_top1 = agreement(model, head, held)
    return head, {
        "steps": steps,
        "first_loss": first,
        "last_loss": last,
        "top1": agreement(model, head, data),
        "held_out_top1": held_top1,
    }
