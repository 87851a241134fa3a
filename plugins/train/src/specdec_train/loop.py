"""The training loop of a draft head: :func:`train_head` and held-out :func:`agreement`.

A draft head (an MTP head, a Gemma 4 assistant) learns ``x[t+2]`` from what the target
computed up to ``t+1``; the labels are the target's own next-token distribution at
``t+1``. Trained on text the target wrote itself, the head learns to propose what the
target would say. The target stays frozen.

What differs between heads is behind :class:`HeadTrainer`: the inputs of one sequence
(:meth:`~HeadTrainer.example`), the forward over a minibatch
(:meth:`~HeadTrainer.forward`) and, for a head with an output layer of its own,
:meth:`~HeadTrainer.logits`. Everything else is here: the losses, the optimiser and its
schedule, minibatching, resuming and held-out agreement; what the target computed is
:mod:`specdec_train.recording`'s.

The losses:

- ``"sampled"`` (the default where the target's output path is affine, as every tied or
  untied ``lm_head`` without soft-capping is): the KL divergence between the target's
  and the head's distributions restricted to a candidate set (the target's
  ``candidates`` most likely tokens at every position of the batch plus ``negatives``
  tokens drawn uniformly: both distributions are exact on that set), plus, for a head
  whose output is a state in the target's hidden space, ``mse_weight`` times the
  squared logit error over the whole vocabulary, ``||W (o - h_{t+1})||^2 / V``,
  through the Gram matrix ``W^T W``;
- ``"full"`` (the fallback for an output path that is not affine, e.g. soft-capping):
  the full-vocabulary KL divergence.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from specdec.capture import model_taps

from .recording import Recorded, TargetOutput, record

LOSSES = ("auto", "sampled", "full")


@runtime_checkable
class HeadTrainer(Protocol):
    """What :func:`train_head` needs of one kind of head.

    Attributes:
        module: the head (an ``mlx.nn.Module``), trained in place.
        kv_layers: indices of the target caches whose K/V the head reads (``()``: none);
            :func:`record` keeps them for every sequence.

    Optional (read by :func:`specdec_train.run_training`): ``feature_layers``, indices of
    the decoder layers whose outputs the head is conditioned on; the model's answers are
    recorded with them (``Recorded.layers``).

    Optional:
        ``logits(module, o, ids=None) -> [..., V or len(ids)]``: the head's own output
        layer, for a head whose output ``o`` is not a state in the target's hidden space
        (the Gemma 4 assistant scores with its own embeddings). Without it, ``o`` goes
        through the target's output path.
        ``extra_loss(module, batch, o) -> [B, L]``: a further per-position loss added to
        the distillation loss (what the head needs besides its first draft's logits: the
        assistant's next-step state, its centroid scores).
        ``eval_logits(module, o) -> [B, L, V]``: the logits the drafter drafts from, when
        they are not the ones trained (a centroid-masked output layer), for
        :func:`agreement`.
    """

    module: nn.Module
    kv_layers: tuple

    def example(self, model: Any, seq: Sequence[int], rec: Recorded) -> dict:
        """The head's inputs for ``seq``: arrays whose first axis is the position
        ``t = 0 .. len(seq) - 3`` (they are right-padded along it into minibatches)."""
        ...

    def forward(self, module: nn.Module, batch: Mapping[str, mx.array]) -> mx.array:
        """``[B, L, ...]``: what scores ``x[t+2]`` at each position (``batch`` holds the
        examples' arrays stacked, and ``valid``, ``[B, L]``, the real positions)."""
        ...


class _Example:
    """One sequence: the trainer's inputs, the target's state at ``t+1`` (its
    distribution over ``x[t+2]``), its argmax and top ids there."""

    __slots__ = ("inputs", "nxt", "top_ids", "target_top1", "n")

    def __init__(self, model: Any, trainer: Any, seq: Sequence[int], k: int, rec: Any) -> None:
        kv_layers = tuple(getattr(trainer, "kv_layers", ()) or ())
        if rec is None or any(i not in rec.kv for i in kv_layers):
            rec = record(model, seq, top_k=k, kv_layers=kv_layers)
        L = len(seq)
        self.n = L - 2
        self.inputs = {
            name: mx.stop_gradient(a) for name, a in trainer.example(model, seq, rec).items()
        }
        self.nxt = rec.hidden[1 : L - 1]
        self.target_top1 = rec.top1[1 : L - 1]
        self.top_ids = rec.top_ids[1 : L - 1, :k]
        mx.eval(self.inputs, self.nxt, self.target_top1, self.top_ids)


def _pad(a: mx.array, L: int) -> mx.array:
    extra = L - a.shape[0]
    return a if not extra else mx.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1))


def _batch(exs: Sequence[_Example]) -> dict:
    """Right-padded ``[B, L, ...]`` arrays and the mask of real positions."""
    L = max(ex.n for ex in exs)
    out = {name: mx.stack([_pad(ex.inputs[name], L) for ex in exs]) for name in exs[0].inputs}
    out["nxt"] = mx.stack([_pad(ex.nxt, L) for ex in exs])
    out["valid"] = mx.array([[i < ex.n for i in range(L)] for ex in exs]).astype(mx.float32)
    return out


def _kl(target_logits: mx.array, logits: mx.array) -> mx.array:
    """KL(target || head) per position over the last axis."""
    lt = target_logits - mx.logsumexp(target_logits, axis=-1, keepdims=True)
    lh = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(lt) * (lt - lh)).sum(axis=-1)


def _head_logits(
    trainer: Any, taps: Any, module: Any, o: mx.array, evaluating: bool = False
) -> mx.array:
    ev = getattr(trainer, "eval_logits", None) if evaluating else None
    if ev is not None:
        return ev(module, o).astype(mx.float32)
    own = getattr(trainer, "logits", None)
    if own is not None:
        return own(module, o).astype(mx.float32)
    return taps.head(o).astype(mx.float32)


def agreement(model: Any, trainer: Any, examples: Sequence[Any]) -> float:
    """The fraction of positions where the head's argmax is the target's: the acceptance
    of a first greedy draft on that text (``nan`` without positions).

    ``examples``: token sequences (recorded here) or the examples :func:`train_head` made.
    """
    taps = model_taps(model)
    right = total = 0
    for ex in examples:
        if not isinstance(ex, _Example):
            if len(ex) < 3:
                continue
            ex = _Example(model, trainer, ex, 1, None)
        b = _batch([ex])
        o = trainer.forward(trainer.module, b)
        pred = mx.argmax(
            _head_logits(trainer, taps, trainer.module, o, evaluating=True)[0], axis=-1
        )
        right += int((pred == ex.target_top1).sum())
        total += ex.n
    return right / total if total else float("nan")


def train_head(
    model: Any,
    trainer: Any,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    start_step: int = 0,
    batch_size: int = 8,
    loss: str = "auto",
    candidates: int = 8,
    negatives: int = 1024,
    mse_weight: float = 0.05,
    warmup: int = 20,
    time_limit: float | None = None,
    states: Sequence[Recorded | None] | None = None,
    held_out_states: Sequence[Recorded | None] | None = None,
    held_out: Sequence[Sequence[int]] = (),
    eval_every: int = 0,
    progress: Callable[[int, int, float, float | None], None] | None = None,
    checkpoint: Callable[[int, Any], None] | None = None,
    checkpoint_every: int = 0,
    name: str = "train_head",
) -> dict:
    """Fit ``trainer.module`` to ``model``'s own distribution over ``sequences``.

    Args:
        model: the target (frozen).
        trainer: a :class:`HeadTrainer`.
        sequences: token sequences to train on (prompt + the target's continuation);
            each needs at least 3 tokens.
        steps: the last step (Adam; a step is one minibatch of ``batch_size`` sequences,
            drawn in a seeded shuffled order, epoch after epoch).
        lr: the peak learning rate (linear warm-up over ``warmup`` steps, then cosine
            decay to a tenth at ``steps``).
        seed: the shuffling seed (and MLX's random seed during training).
        start_step: steps already done (resuming: training runs ``start_step+1 .. steps``).
        loss: ``"sampled"``, ``"full"`` or ``"auto"`` (``sampled`` where the target's
            output path is affine); see the module's docstring.
        candidates: the target's most likely tokens per position put in the candidate set.
        negatives: tokens drawn uniformly into the candidate set every step.
        mse_weight: the weight of the whole-vocabulary logit error (``sampled``, heads
            without an output layer of their own).
        time_limit: stop after this many seconds of training (checked after each step);
            the learning rate then decays over whichever ends first, steps or time.
        states: the target's :class:`Recorded` over each sequence (as
            :func:`batch_answers` records them), so no teacher-forced forward is needed;
            ``None`` (or a ``None`` entry, or one without the K/V the head reads):
            recorded here.
        held_out_states: the same for ``held_out``.
        held_out: sequences never trained on, for :func:`agreement` every
            ``eval_every`` steps and at the end.
        progress: ``progress(step, steps, loss, held_out_agreement_or_None)`` per step.
        checkpoint: ``checkpoint(step, module)`` every ``checkpoint_every`` steps.
        name: how errors name the caller.

    Returns:
        ``{"steps", "first_loss", "last_loss", "top1", "held_out_top1", "loss",
        "train_seconds", "prepare_seconds", "stopped_by_time"}`` (``steps``: the last step
        done; ``top1``: the agreement on the training text; ``train_seconds``: the steps
        and the evaluations during them; ``prepare_seconds``: recording the target's
        states where they were not given).

    Raises:
        ValueError: no sequence of at least 3 tokens, ``steps <= start_step``, or a bad
            ``loss``, ``batch_size``, ``candidates`` or ``negatives``.
    """
    import mlx.optimizers as optim

    seqs = [list(s) for s in sequences if len(s) >= 3]
    if not seqs:
        raise ValueError(f"{name}: give at least one sequence of 3 or more tokens")
    if steps < 1 or steps <= start_step:
        raise ValueError(
            f"{name}: steps must be >= 1 and above start_step ({start_step}), got {steps}"
        )
    if loss not in LOSSES:
        raise ValueError(f"{name}: loss must be one of {LOSSES}, got {loss!r}")
    for label, v, lo in (("batch_size", batch_size, 1), ("candidates", candidates, 1)):
        if v < lo:
            raise ValueError(f"{name}: {label} must be >= {lo}, got {v}")
    if negatives < 0:
        raise ValueError(f"{name}: negatives must be >= 0, got {negatives}")
    taps = model_taps(model)
    out = TargetOutput(model)
    own_logits = getattr(trainer, "logits", None)
    extra = getattr(trainer, "extra_loss", None)
    if loss == "auto":
        loss = "sampled" if out.affine else "full"
    elif loss == "sampled" and not out.affine:
        raise ValueError(
            f"{name}: loss 'sampled' needs an affine output layer and this model's "
            "is not (e.g. soft-capped logits); use 'full' or 'auto'"
        )
    if states is not None and len(states) != len(sequences):
        raise ValueError(f"{name}: {len(states)} states for {len(sequences)} sequences")
    t_prepare = time.perf_counter()
    data = [
        _Example(model, trainer, s, candidates, None if states is None else states[i])
        for i, s in enumerate(sequences)
        if len(s) >= 3
    ]
    if held_out_states is not None and len(held_out_states) != len(held_out):
        raise ValueError(
            f"{name}: {len(held_out_states)} states for {len(held_out)} held-out sequences"
        )
    held = [
        _Example(model, trainer, s, 1, None if held_out_states is None else held_out_states[i])
        for i, s in enumerate(held_out)
        if len(s) >= 3
    ]
    prepare_seconds = time.perf_counter() - t_prepare
    mx.random.seed(seed)
    head = trainer.module
    head.train()
    optimizer = optim.Adam(learning_rate=lr)
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    vocab = out.vocab

    def lr_at(step: int) -> float:  # step: 1-based
        warm = min(1.0, step / max(1, warmup))
        frac = min(1.0, (step - 1) / max(1, steps - 1))
        if time_limit:
            frac = max(frac, min(1.0, (time.perf_counter() - t0) / time_limit))
        return lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))

    def sampled_loss(m: Any, b: dict, ids: mx.array) -> mx.array:
        o = trainer.forward(m, b)
        valid = b["valid"]
        mine = own_logits(m, o, ids) if own_logits is not None else out.logits(o, ids)
        loss_ = _kl(out.logits(b["nxt"], ids), mine.astype(mx.float32))
        if own_logits is None and mse_weight:
            d = o - b["nxt"]
            loss_ = loss_ + mse_weight * ((d @ out.gram) * d).sum(axis=-1) / vocab
        if extra is not None:
            loss_ = loss_ + extra(m, b, o)
        return (loss_ * valid).sum() / valid.sum()

    def full_loss(m: Any, b: dict) -> mx.array:
        o = trainer.forward(m, b)
        valid = b["valid"]
        kl = _kl(taps.head(b["nxt"]).astype(mx.float32), _head_logits(trainer, taps, m, o))
        if extra is not None:
            kl = kl + extra(m, b, o)
        return (kl * valid).sum() / valid.sum()

    grad_sampled = nn.value_and_grad(head, sampled_loss)
    grad_full = nn.value_and_grad(head, full_loss)
    order: list[int] = []
    # Resuming continues the same shuffled stream of minibatches.
    per_epoch = math.ceil(len(data) / batch_size)
    for _ in range(start_step // per_epoch):
        rng.shuffle(list(range(len(data))))
    skip = (start_step % per_epoch) * batch_size

    def next_batch() -> list[_Example]:
        nonlocal skip
        picked: list[_Example] = []
        while len(picked) < min(batch_size, len(data)):
            if not order:
                idx = list(range(len(data)))
                rng.shuffle(idx)
                order.extend(idx)
                if skip:
                    del order[:skip]
                    skip = 0
            picked.append(data[order.pop(0)])
            if not order and picked:
                break  # an epoch's last (maybe smaller) batch
        return picked

    first = last = None
    held_top1 = None
    t0 = time.perf_counter()
    done = start_step
    stopped_by_time = False
    for i in range(start_step, steps):
        step = i + 1
        optimizer.learning_rate = lr_at(step)
        exs = next_batch()
        b = _batch(exs)
        if loss == "sampled":
            cand = np.concatenate([np.asarray(ex.top_ids).reshape(-1) for ex in exs])
            if negatives:
                cand = np.concatenate([cand, nprng.integers(0, vocab, size=negatives)])
            ids = mx.array(np.unique(cand).astype(np.int32))
            value, grads = grad_sampled(head, b, ids)
        else:
            value, grads = grad_full(head, b)
        optimizer.update(head, grads)
        mx.eval(head.parameters(), optimizer.state, value)
        last = float(value)
        if first is None:
            first = last
        done = step
        if held and eval_every and (step % eval_every == 0 or step == steps):
            head.eval()
            held_top1 = agreement(model, trainer, held)
            head.train()
        if progress is not None:
            progress(step, steps, last, held_top1)
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0:
            checkpoint(step, head)
        if time_limit is not None and time.perf_counter() - t0 >= time_limit and step < steps:
            stopped_by_time = True
            break
    train_seconds = time.perf_counter() - t0
    head.eval()
    if held and (held_top1 is None or stopped_by_time or done % max(1, eval_every)):
        held_top1 = agreement(model, trainer, held)
    return {
        "steps": done,
        "first_loss": first,
        "last_loss": last,
        "loss": loss,
        "top1": agreement(model, trainer, data),
        "held_out_top1": held_top1,
        "train_seconds": round(train_seconds, 1),
        "prepare_seconds": round(prepare_seconds, 1),
        "stopped_by_time": stopped_by_time,
    }
