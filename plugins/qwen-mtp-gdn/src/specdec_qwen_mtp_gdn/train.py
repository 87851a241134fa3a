"""Train an MTP head for a model on its own distribution (the target stays frozen).

The head learns ``x[t+2]`` from ``(h_t, x[t+1])`` exactly as ``qwen_mtp`` drafts with
it: ``h_t`` is the target's hidden state after its final norm and the logits come from
the target's own output path. The loop, the losses, the recording of the target's
states and the batched answers are specdec-train's :mod:`specdec_train` (shared with the
other head plugins); this module is what is particular to the MTP head:
:class:`MTPTrainer` (its inputs and forward) and :func:`train_mtp_head`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import specdec_train

from .mtp import QwenMTP, text_model

__all__ = [
    "LOSSES",
    "MTPTrainer",
    "OutputLayer",
    "States",
    "agreement",
    "batch_answers",
    "target_hidden",
    "train_mtp_head",
]

#: The names this module had before the loop moved to the core (0.3.3): kept.
LOSSES = specdec_train.LOSSES
Recorded = specdec_train.Recorded
batch_answers = specdec_train.batch_answers
target_hidden = specdec_train.target_hidden
States = Recorded
OutputLayer = specdec_train.TargetOutput


def agreement(model: Any, head: QwenMTP, sequences: Sequence[Sequence[int]]) -> float:
    """The fraction of positions of ``sequences`` where ``head``'s argmax is the target's
    (the acceptance of a first greedy draft there)."""
    return specdec_train.agreement(model, MTPTrainer(head, model), sequences)


class MTPTrainer:
    """The MTP head for :func:`specdec_train.train_head`: its inputs are the target's
    embeddings of ``x[t+1]`` and ``h_t``; its output is a state in the target's hidden
    space, scored through the target's own output path."""

    kv_layers: tuple = ()

    def __init__(self, module: QwenMTP | None, model: Any, layers: int = 1, seed: int = 0):
        self._module = module
        self._make = (model, layers, seed)

    @property
    def module(self) -> QwenMTP:
        """The head (a new one, seeded, when no ``init`` was given: built on first use,
        after :func:`specdec_train.train_head` has checked its arguments)."""
        if self._module is None:
            model, layers, seed = self._make
            mx.random.seed(seed)
            self._module = QwenMTP(model, layers)
        return self._module

    def example(self, model: Any, seq: Sequence[int], rec: Recorded) -> dict:
        n = len(seq) - 2
        toks = mx.array(list(seq[1:-1]))
        emb = text_model(model).model.embed_tokens(toks).astype(mx.float32)
        return {"emb": emb, "hid": rec.hidden[:n]}

    def forward(self, module: QwenMTP, batch: Mapping[str, mx.array]) -> mx.array:
        return module(batch["emb"], batch["hid"], [None] * len(module.layers))


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
    checkpoint: Callable[[int, QwenMTP], None] | None = None,
    checkpoint_every: int = 0,
) -> tuple[QwenMTP, dict]:
    """Fit a :class:`~specdec_qwen_mtp_gdn.mtp.QwenMTP` head to ``model``'s own text.

    Args:
        model: the target (frozen).
        sequences: token sequences to train on (prompt + the target's continuation);
            each needs at least 3 tokens.
        steps: the last step (Adam; a step is one minibatch of ``batch_size`` sequences,
            drawn in a seeded shuffled order, epoch after epoch).
        lr: the peak learning rate (linear warm-up over ``warmup`` steps, then cosine
            decay to a tenth at ``steps``).
        layers: MTP decoder layers (when no ``init`` is given).
        seed: the initialisation and shuffling seed.
        init: a head to start from (a checkpoint's), trained in place.
        start_step: steps already done (resuming: training runs ``start_step+1 .. steps``).
        loss: ``"sampled"`` (candidate-set KL plus the Gram-matrix logit error, see the
            module's docstring), ``"full"`` (full-vocabulary KL) or ``"auto"``
            (``sampled`` where the output path is affine).
        candidates: the target's most likely tokens per position put in the candidate set.
        negatives: tokens drawn uniformly into the candidate set every step.
        mse_weight: the weight of the whole-vocabulary logit error (``sampled``).
        time_limit: stop after this many seconds of training (checked after each step);
            the learning rate then decays over whichever ends first, steps or time.
        states: the target's :class:`specdec_train.Recorded` over each sequence (as
            :func:`batch_answers` records them while the model writes its answers), so
            no teacher-forced forward is needed; ``None`` (or a ``None`` entry):
            computed here.
        held_out_states: the same for ``held_out``.
        held_out: sequences never trained on, for :func:`agreement` (acceptance of the
            first draft) every ``eval_every`` steps and at the end.
        progress: ``progress(step, steps, loss, held_out_agreement_or_None)`` per step.
        checkpoint: ``checkpoint(step, head)`` every ``checkpoint_every`` steps.

    Returns:
        the head and ``{"steps", "first_loss", "last_loss", "top1", "held_out_top1",
        "loss", "train_seconds", "stopped_by_time"}`` (``steps``: the last step done;
        ``top1``: the agreement on the training text).

    Raises:
        ValueError: no sequence of at least 3 tokens, ``steps <= start_step``, or a bad
            ``loss``, ``batch_size``, ``candidates`` or ``negatives``.
    """
    trainer = MTPTrainer(init if init is not None else None, model, layers, seed)
    st = specdec_train.train_head(
        model,
        trainer,
        sequences,
        steps=steps,
        lr=lr,
        seed=seed,
        start_step=start_step,
        batch_size=batch_size,
        loss=loss,
        candidates=candidates,
        negatives=negatives,
        mse_weight=mse_weight,
        warmup=warmup,
        time_limit=time_limit,
        states=states,
        held_out_states=held_out_states,
        held_out=held_out,
        eval_every=eval_every,
        progress=progress,
        checkpoint=checkpoint,
        checkpoint_every=checkpoint_every,
        name="train_mtp_head",
    )
    return trainer.module, st
