"""Self-distillation of draft heads: the training loop the head plugins share.

A draft head (an MTP head, a Gemma 4 assistant) learns ``x[t+2]`` from what the target
computed up to ``t+1``; the labels are the target's own next-token distribution at
``t+1``. Trained on text the target wrote itself, the head learns to propose what the
target would say. The target stays frozen.

What differs between heads is behind :class:`HeadTrainer`: the inputs of one sequence
(:meth:`~HeadTrainer.example`), the forward over a minibatch
(:meth:`~HeadTrainer.forward`) and, for a head with an output layer of its own,
:meth:`~HeadTrainer.logits`. Everything else is here: recording what the target
computed (:func:`record`, :func:`batch_answers`), the losses, the optimiser and its
schedule, minibatching, resuming, held-out agreement (:func:`agreement`) and the
target's identity (:func:`target_identity`) that a trained head is checked against.

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

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from specdec import (
    ModelLoadError,
    Progress,
    SpecdecError,
    assemble,
    model_taps,
    model_vocab_size,
    output_layer,
)
from specdec.checkpoints import target_identity, text_model

LOSSES = ("auto", "sampled", "full")


class Recorded:
    """What the target computed over one sequence.

    Attributes:
        hidden: ``[n, H]`` hidden states after the final norm.
        top_ids: ``[n, k]`` the ``k`` most likely next tokens at each position.
        top1: ``[n]`` the argmax at each position.
        kv: ``{cache index: (keys, values)}``, each ``[n, kv_heads, head_dim]``
            (position first), for the caches asked for (``kv_layers``); empty otherwise.
    """

    __slots__ = ("hidden", "top_ids", "top1", "kv")

    def __init__(
        self, hidden: mx.array, top_ids: mx.array, top1: mx.array, kv: dict | None = None
    ) -> None:
        self.hidden, self.top_ids, self.top1 = hidden, top_ids, top1
        self.kv = kv or {}

    @classmethod
    def of(cls, hidden: mx.array, logits: mx.array, k: int, kv: dict | None = None) -> Recorded:
        """From hidden states and logits ``[n, V]``."""
        logits = logits.astype(mx.float32)
        k = max(1, min(k, logits.shape[-1]))
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        return cls(hidden.astype(mx.float32), ids, mx.argmax(logits, axis=-1), kv)


def _forward(
    model: Any, tokens: Sequence[int], kv_layers: Sequence[int] = ()
) -> tuple[mx.array, mx.array, dict]:
    """One teacher-forced forward: hidden ``[L, H]``, logits ``[L, V]`` float32, and the
    K/V ``{i: ([L, kv_heads, d], ...)}`` of the caches ``kv_layers``."""
    from mlx_lm.models.cache import make_prompt_cache

    taps = model_taps(model)
    caches = make_prompt_cache(model) if kv_layers else None
    with taps.recording() as rec:
        logits = model(mx.array(list(tokens))[None], cache=caches)
    h = rec["hidden"][0]
    kv = {}
    n = len(tokens)
    for i in kv_layers:
        # A fresh cache given one multi-token update holds every position in order, a
        # rotating one too (it keeps the whole update before any later step trims it).
        c = caches[i]
        if c.keys is None or c.keys.shape[2] < n:
            raise ModelLoadError(
                f"training: cache {i} of {type(model).__name__} does not hold the K/V of all "
                f"{n} positions after one forward ({type(c).__name__})"
            )
        # in the model's dtype, copied out of the cache's buffer
        kv[i] = tuple(mx.contiguous(x[0, :, :n, :].transpose(1, 0, 2)) for x in (c.keys, c.values))
    mx.eval(h, logits, kv)
    return h, logits[0].astype(mx.float32), kv


def record(
    model: Any, tokens: Sequence[int], *, top_k: int = 1, kv_layers: Sequence[int] = ()
) -> Recorded:
    """What the target computes over ``tokens``, in one teacher-forced forward.

    Args:
        top_k: most likely next tokens kept per position.
        kv_layers: indices (in the model's cache list) of the caches whose keys and
            values to keep, for heads that attend to the target's K/V.
    """
    h, logits, kv = _forward(model, tokens, kv_layers)
    return Recorded.of(h, logits, top_k, kv)


def target_hidden(model: Any, tokens: Sequence[int]) -> mx.array:
    """The target's hidden states ``[L, H]`` (after its final norm) for ``tokens``, one forward."""
    return _forward(model, tokens)[0]


class TargetOutput:
    """The target's output path as ``logits = h @ W.T + b`` (``W``: ``[V, H]``), read
    through :func:`specdec.output_layer`: the layer's rows, dequantized, with a logit
    scale folded in.

    :attr:`affine` says whether the path really is affine (nothing but a scale after
    the layer; soft-capping is not); only then are :attr:`weight`, :attr:`bias` and
    :attr:`gram` (``W.T @ W``, built on first use) there.
    """

    def __init__(self, model: Any):
        try:
            layer = output_layer(model)
        except ModelLoadError:  # an output path the core cannot read as rows
            layer = None
        post = None if layer is None else layer.post
        self.affine = layer is not None and (post is None or post[0] in ("mul", "div"))
        self.vocab = int(layer.vocab_size if layer is not None else model_vocab_size(model))
        self.weight = self.bias = None
        self._gram = None
        if self.affine:
            scale = 1.0 if post is None else (post[1] if post[0] == "mul" else 1.0 / post[1])
            w = layer.dense().astype(mx.float32)
            b = None if layer.bias is None else layer.bias.astype(mx.float32)
            self.weight = w if scale == 1.0 else w * scale
            self.bias = None if b is None else (b if scale == 1.0 else b * scale)
            mx.eval(self.weight, self.bias)

    @property
    def gram(self) -> mx.array:
        """``W.T @ W`` (``[H, H]``), for the whole vocabulary's logit error of a state error."""
        if self._gram is None:
            self._gram = self.weight.T @ self.weight
            mx.eval(self._gram)
        return self._gram

    def logits(self, h: mx.array, ids: mx.array | None = None) -> mx.array:
        """Logits of ``h`` (``[..., H]``) over the whole vocabulary or over ``ids``."""
        w = self.weight if ids is None else self.weight[ids]
        z = h @ w.T
        if self.bias is not None:
            z = z + (self.bias if ids is None else self.bias[ids])
        return z


@runtime_checkable
class HeadTrainer(Protocol):
    """What :func:`train_head` needs of one kind of head.

    Attributes:
        module: the head (an ``mlx.nn.Module``), trained in place.
        kv_layers: indices of the target caches whose K/V the head reads (``()``: none);
            :func:`record` keeps them for every sequence.

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


def _plain_cache_only(model: Any) -> bool:
    from mlx_lm.models.cache import KVCache

    try:
        caches = model.make_cache() if hasattr(model, "make_cache") else None
    except Exception:  # noqa: BLE001 - a model that cannot say: answer one by one
        return False
    if caches is None:
        return all(hasattr(lyr, "self_attn") for lyr in text_model(model).model.layers)
    return all(type(c) is KVCache for c in caches)


def batch_answers(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    eos: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    batch_size: int = 16,
    record: int = 0,
    kv_layers: Sequence[int] = (),
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[list[int]], list[Recorded] | None] | None:
    """The model's answers to ``prompts`` (token lists, without the prompt), decoded in
    left-padded batches through mlx-lm's ``BatchKVCache``: many times faster than one
    prompt at a time on a CPU. Greedy at ``temperature`` 0, else sampled. An answer stops
    after an ``eos`` token (kept out).

    Args:
        record: also return the target's :class:`Recorded` over each ``prompt + answer``
            with this many top token ids per position (the forwards that wrote the
            answers computed them: no second pass); 0: ``None`` instead.
        kv_layers: with ``record``, also keep the K/V of these caches (each row's own
            entries, sliced out of the batch caches).

    Returns:
        ``(answers, states)``, or ``None`` for a model whose caches are not all plain
        K/V caches (sliding-window or linear-attention layers): answer those one by one.
    """
    if not _plain_cache_only(model):
        return None
    from mlx_lm.models.cache import BatchKVCache

    taps = model_taps(model) if record else None
    n_caches = (
        len(model.make_cache())
        if hasattr(model, "make_cache")
        else len(text_model(model).model.layers)
    )
    stop = set(int(t) for t in eos)
    key = mx.random.key(seed)
    answers: list[list[int]] = []
    states: list[Recorded] = []
    for start in range(0, len(prompts), batch_size):
        group = [list(p) for p in prompts[start : start + batch_size]]
        width = max(len(p) for p in group)
        pads = [width - len(p) for p in group]
        x = mx.array([[0] * pad + p for pad, p in zip(pads, group)])
        cache = [BatchKVCache(pads) for _ in range(n_caches)]
        outs: list[list[int]] = [[] for _ in group]
        alive = [True] * len(group)
        steps: list[tuple[mx.array, mx.array, mx.array]] = []  # per forward: h, ids, top1
        for _ in range(max_tokens):
            if taps is not None:
                with taps.recording() as rec:
                    out = model(x, cache=cache)
                st = Recorded.of(
                    rec["hidden"].reshape(-1, rec["hidden"].shape[-1]),
                    out.reshape(-1, out.shape[-1]),
                    record,
                )
                n_in = x.shape[1]
                steps.append(
                    (
                        st.hidden.reshape(len(group), n_in, -1),
                        st.top_ids.reshape(len(group), n_in, -1),
                        st.top1.reshape(len(group), n_in),
                    )
                )
                logits = out[:, -1, :].astype(mx.float32)
            else:
                logits = model(x, cache=cache)[:, -1, :].astype(mx.float32)
            if temperature > 0:
                key, sub = mx.random.split(key)
                tok = mx.random.categorical(logits / temperature, key=sub)
            else:
                tok = mx.argmax(logits, axis=-1)
            mx.eval(tok, *(steps[-1] if steps else ()))
            for r, t in enumerate(tok.tolist()):
                if alive[r]:
                    if t in stop:
                        alive[r] = False
                    else:
                        outs[r].append(int(t))
            if not any(alive):
                break
            x = tok[:, None]
        answers.extend(outs)
        if taps is not None:
            h, ids, top1 = (mx.concatenate([s[j] for s in steps], axis=1) for j in range(3))
            for r, (pad, p) in enumerate(zip(pads, group)):
                n = len(p) + len(outs[r])  # positions 0 .. n-1 (or n-2: the last is not fed)
                end = min(pad + n, h.shape[1])
                kv = {}
                for i in kv_layers:
                    c = cache[i]
                    # the row's own entries, copied so the group's buffers are not kept
                    kv[i] = tuple(
                        mx.contiguous(x[r, :, pad:end, :].transpose(1, 0, 2))
                        for x in (c.keys, c.values)
                    )
                states.append(Recorded(h[r, pad:end], ids[r, pad:end], top1[r, pad:end], kv))
            mx.eval([(s.hidden, s.top_ids, s.top1, s.kv) for s in states[-len(group) :]])
        if on_batch is not None:
            on_batch(len(group))
    return answers, (states if taps is not None else None)


# -- the command line shared by the training commands (train-head, train-assistant) -------

#: What a training command's output folder holds besides the head's checkpoint.
STATE_FILE = "train_state.json"
DATA_FILE = "train_data.json"
SUMMARY_FILE = "train_head.json"


class TrainError(SpecdecError, ValueError):
    """Bad input to a training command (the message names it and what would be accepted)."""


def shipped_prompts() -> list[str]:
    """The prompts shipped for self-distillation (``specdec_train/data/train_prompts.txt``; none
    is a bench workload)."""
    from importlib import resources

    text = resources.files("specdec_train").joinpath("data/train_prompts.txt").read_text("utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


@attrs.frozen
class TrainCommand:
    """What one training command adds to :func:`run_training`.

    Attributes:
        name: the subcommand (``"train-head"``), for messages and progress bars.
        make_trainer: ``make_trainer(model, args, resume)``: the :class:`HeadTrainer`;
            ``resume`` is the output folder to load the head from (float32), or ``None``
            for a new head.
        save: ``save(out, model, module, identity)``: write the head to ``out`` with the
            target's identity (:data:`specdec.checkpoints.TARGET_FIELD`) in its config.
        usage: ``usage(out)``: what to print on stdout at the end (how to use the head).
    """

    name: str
    make_trainer: Callable[[Any, Any, Any], Any]
    save: Callable[[Any, Any, Any, dict], None]
    usage: Callable[[Any], str]


def add_training_arguments(p: Any, *, lr: float = 1e-3) -> None:
    """Add the flags every training command has to the argparse parser ``p`` (a head's
    own flags, such as ``--layers``, are the command's)."""
    p.add_argument(
        "--model", default=None, help="model folder (default: the built-in default model)"
    )
    p.add_argument("--out", required=True, help="folder to write the head to")
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts for the model to answer, one per line (default: the shipped ones)",
    )
    p.add_argument(
        "--text",
        action="append",
        default=[],
        metavar="FILE",
        help="also train on windows of this UTF-8 text, each continued by the model (repeatable)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all (default: 300)")
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default: {lr:g})")
    p.add_argument(
        "--max-sequences",
        type=int,
        default=200,
        help="prompts and --text windows in all, held out ones too (default: 200)",
    )
    p.add_argument(
        "--continue",
        dest="continue_tokens",
        type=int,
        default=128,
        help="tokens the model writes per prompt or window (default: 128)",
    )
    p.add_argument(
        "--seq-len", type=int, default=128, help="tokens per --text window (default: 128)"
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.1,
        help="fraction of the prompts held out, with all their answers (default: 0.1)",
    )
    p.add_argument(
        "--answers",
        type=int,
        default=4,
        help="answers the model writes per prompt or window: the first greedy, the others "
        "sampled at --sample-temp (default: 4)",
    )
    p.add_argument(
        "--sample-temp",
        type=float,
        default=0.8,
        help="the temperature of the sampled answers (default: 0.8)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per optimizer step (default: 8)"
    )
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default="auto",
        help="sampled: KL over a candidate set (plus, for a head scored by the target's "
        "output layer, the whole vocabulary's logit error through its Gram matrix): cheap; "
        "full: KL over the whole vocabulary; auto: sampled where the output layer is affine "
        "(default: auto)",
    )
    p.add_argument(
        "--candidates",
        type=int,
        default=8,
        help="the target's most likely tokens per position in the sampled loss's "
        "candidate set (default: 8)",
    )
    p.add_argument(
        "--negatives",
        type=int,
        default=1024,
        help="tokens drawn uniformly into the candidate set every step (default: 1024)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop training after this many minutes (the data's generation not counted) "
        "and save the head (default: no limit)",
    )
    p.add_argument(
        "--save-every", type=int, default=50, help="checkpoint interval in steps (default: 50)"
    )
    p.add_argument("--resume", action="store_true", help="continue the training saved in --out")
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help="train on the sequences of an earlier run's train_data.json (another head on the "
        "same text, without the model answering again) instead of new answers",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the initialisation, the minibatch order, the sampled answers and "
        "the negatives (default: 0)",
    )
    p.add_argument("--force", action="store_true", help="start afresh in a non-empty --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _check_args(args: Any) -> Any:
    import os
    from pathlib import Path

    for label, lo in (
        ("steps", 1),
        ("seq_len", 3),
        ("max_sequences", 2),
        ("continue_tokens", 1),
        ("save_every", 1),
        ("answers", 1),
        ("batch_size", 1),
        ("candidates", 1),
        ("negatives", 0),
    ):
        v = getattr(args, label)
        if v < lo:
            flag = "--continue" if label == "continue_tokens" else f"--{label.replace('_', '-')}"
            raise TrainError(f"{flag} must be >= {lo}, got {v}")
    if not args.lr > 0:
        raise TrainError(f"--lr must be > 0, got {args.lr}")
    if not args.sample_temp > 0:
        raise TrainError(f"--sample-temp must be > 0, got {args.sample_temp}")
    if args.minutes is not None and not args.minutes > 0:
        raise TrainError(f"--minutes must be > 0, got {args.minutes}")
    if not 0 < args.held_out < 1:
        raise TrainError(f"--held-out must be a fraction in (0, 1), got {args.held_out}")
    for f in [*args.text, *([args.prompts] if args.prompts else [])]:
        if not os.path.isfile(f):
            raise TrainError(f"{f!r} is not a file")
    data = getattr(args, "data", None)
    if data is not None:
        if args.resume:
            raise TrainError("--data and --resume exclude each other (a resumed run has its data)")
        if args.prompts or args.text:
            raise TrainError("--data takes the sequences of an earlier run: no --prompts or --text")
        _read_data(data)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {str(out)!r} exists and is not a folder")
    if args.resume:
        if args.force:
            raise TrainError("--resume and --force exclude each other")
        if not (out / STATE_FILE).is_file() or not (out / DATA_FILE).is_file():
            raise TrainError(
                f"--resume: {str(out)!r} holds no training to resume ({STATE_FILE} and "
                f"{DATA_FILE} are written at the first checkpoint)"
            )
    elif out.is_dir() and any(out.iterdir()) and not args.force:
        raise TrainError(
            f"--out {str(out)!r} is not empty; choose another folder, --resume the training "
            "in it, or pass --force to start afresh"
        )
    return out


def _read_data(path: str) -> dict:
    """An earlier run's ``train_data.json``: ``train`` and ``held_out`` token lists."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrainError(f"--data {path!r} cannot be read as JSON: {exc}") from exc
    ok = isinstance(data, dict) and all(
        isinstance(data.get(k), list)
        and all(isinstance(s, list) and all(isinstance(t, int) for t in s) for s in data[k])
        for k in ("train", "held_out")
    )
    if not ok or not data["train"] or not data["held_out"]:
        raise TrainError(
            f"--data {path!r} is not a train_data.json: it needs non-empty 'train' and "
            "'held_out' lists of token-id lists"
        )
    return data


def _read_lines(path: str) -> list[str]:
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainError(f"{path!r} cannot be read as UTF-8 text: {exc}") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def prompt_ids(
    pipe: Any,
    *,
    prompts: str | None = None,
    text: Sequence[str] = (),
    seq_len: int = 128,
    seed: int = 0,
    max_sequences: int = 200,
) -> list[list[int]]:
    """The training commands' prompts as token lists, in their seeded order (the last
    ``--held-out`` of them are held out): the lines of ``prompts`` (a file; default the
    shipped ones) through the chat template when the tokenizer has one, then windows of
    ``seq_len`` tokens of each ``text`` file; shuffled with ``seed``, the first
    ``max_sequences`` kept."""
    from pathlib import Path

    lines = _read_lines(prompts) if prompts else shipped_prompts()
    has_template = getattr(pipe.tokenizer, "chat_template", None) is not None
    ids = [pipe.encode_prompt(p, chat_template=has_template) for p in lines]
    for f in text:
        toks = [int(t) for t in pipe.tokenizer.encode(Path(f).read_text(encoding="utf-8"))]
        ids.extend(toks[i : i + seq_len] for i in range(0, len(toks) - 2, seq_len))
    ids = [list(p) for p in ids if len(p) >= 1]
    if len(ids) < 2:
        raise TrainError("need at least 2 prompts or text windows (one is held out)")
    # A seeded shuffle: --max-sequences and the held-out tail mix prompts and windows.
    random.Random(seed).shuffle(ids)
    return ids[:max_sequences]


def _prompt_ids(args: Any, pipe: Any) -> list[list[int]]:
    return prompt_ids(
        pipe,
        prompts=args.prompts,
        text=args.text,
        seq_len=args.seq_len,
        seed=args.seed,
        max_sequences=args.max_sequences,
    )


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return [int(t) for t in ids]


def _make_data(
    args: Any, pipe: Any, show: bool, command: str, kv_layers: Sequence[int]
) -> tuple[dict, tuple[list, list]]:
    """The model's answers: ``--answers`` per prompt (the first greedy), whole prompts held
    out (their answers are alike, so a held-out answer of a trained prompt would flatter)."""
    prompts = _prompt_ids(args, pipe)
    n_held = max(1, round(len(prompts) * args.held_out))
    if n_held >= len(prompts):
        raise TrainError(
            f"--held-out {args.held_out} of {len(prompts)} prompts leaves none to train on; "
            "lower it or add prompts"
        )
    total = len(prompts) * args.answers
    bar = Progress(total, prefix=f"{command}: the model answers", enabled=show)
    eos = _eos_ids(pipe.tokenizer)
    answers: list[list[list[int]]] = [[] for _ in prompts]
    states: list[list[Any]] = [[] for _ in prompts]
    for a in range(args.answers):
        temp = 0.0 if a == 0 else args.sample_temp
        bar.start(f"answer {a + 1} of {args.answers}" + (f" (temp {temp})" if temp else ""))
        got = batch_answers(
            pipe.model,
            prompts,
            max_tokens=args.continue_tokens,
            eos=eos,
            temperature=temp,
            seed=args.seed + a,
            record=args.candidates,
            kv_layers=kv_layers,
            on_batch=bar.advance,
        )
        if got is not None:
            got, recorded = got
        else:  # sliding-window or linear-attention caches: one prompt at a time
            got, recorded = [], [None] * len(prompts)
            for p in prompts:
                res = pipe.generate(
                    p, max_tokens=args.continue_tokens, temperature=temp, seed=args.seed + a
                )
                got.append(list(res.tokens))
                bar.advance()
        for i, ans in enumerate(got):
            answers[i].append(list(prompts[i]) + list(ans))
            states[i].append(recorded[i])
    bar.close()
    train = [s for group in answers[:-n_held] for s in group]
    held = [s for group in answers[-n_held:] for s in group]
    data = {
        "train": train,
        "held_out": held,
        "prompts": len(prompts),
        "held_out_prompts": n_held,
        "held_out_prompt_ids": prompts[-n_held:],
    }
    # The target's states over the training text, recorded while it wrote it (not saved:
    # --resume computes them again).
    return data, (
        [st for group in states[:-n_held] for st in group],
        [st for group in states[-n_held:] for st in group],
    )


def run_training(args: Any, command: TrainCommand) -> int:
    """Run a training command: the model answers the prompts, the head trains on the
    answers (progress bars on stderr, checkpoints every ``--save-every`` steps, resumable),
    and a summary is written to ``train_head.json``.

    Raises:
        TrainError: bad arguments (before the model is loaded), or a training that
            cannot run.
    """
    import json
    import sys

    out = _check_args(args)
    t0 = time.perf_counter()
    show = not args.no_progress
    pipe = assemble(args.model, policy="none")
    model = pipe.model
    identity = target_identity(model)
    if args.loss == "sampled" and not TargetOutput(model).affine:  # before minutes of answers
        raise TrainError(
            "--loss sampled needs an affine output layer and this model's is not (e.g. "
            "soft-capped logits); use --loss full or auto"
        )
    start = 0
    data_seconds = 0.0
    states = held_states = None
    if args.resume:
        state = json.loads((out / STATE_FILE).read_text())
        data = json.loads((out / DATA_FILE).read_text())
        if state.get("target") != identity:
            raise TrainError(f"--resume: the training in {str(out)!r} is for another model")
        for key, flag in (("seed", "--seed"), ("batch_size", "--batch-size")):
            if key in state and state[key] != getattr(args, key):
                raise TrainError(
                    f"--resume: the training in {str(out)!r} ran with {flag} {state[key]}; "
                    f"give the same {flag} to continue its minibatch order"
                )
        data_seconds = float(state.get("data_seconds", 0.0))
        start = int(state["step"])
        if start >= args.steps:
            raise TrainError(
                f"--resume: {start} steps are done already; give --steps above {start}"
            )
        trainer = command.make_trainer(model, args, out)
    else:
        trainer = command.make_trainer(model, args, None)
        out.mkdir(parents=True, exist_ok=True)
        for name in (STATE_FILE, DATA_FILE, SUMMARY_FILE):
            (out / name).unlink(missing_ok=True)
        t_data = time.perf_counter()
        kv_layers = tuple(getattr(trainer, "kv_layers", ()) or ())
        if getattr(args, "data", None) is not None:
            # the target's states are recorded again, one teacher-forced forward each
            data = _read_data(args.data)
            vocab = int(model_vocab_size(text_model(model)) or 0)
            if any(t >= vocab or t < 0 for s in data["train"] + data["held_out"] for t in s):
                raise TrainError(
                    f"--data {args.data!r} has token ids outside this model's vocabulary"
                )
        else:
            data, (states, held_states) = _make_data(args, pipe, show, command.name, kv_layers)
        data_seconds = round(time.perf_counter() - t_data, 1)
        (out / DATA_FILE).write_text(json.dumps(data) + "\n")

    def save(step: int, module: Any) -> None:
        command.save(out, model, module, identity)
        state = {
            "step": step,
            "target": identity,
            "lr": args.lr,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "data_seconds": data_seconds,
        }
        (out / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    bar = Progress(args.steps - start, prefix=f"{command.name}: training", enabled=show)
    bar.start(f"step {start}")

    def progress(step: int, total: int, loss: float, held: float | None) -> None:
        bar.advance()
        label = f"loss {loss:.3f}" + ("" if held is None else f", held-out top-1 {held:.1%}")
        if step % args.save_every == 0 or step == total:
            bar.start(label)  # a line in a log too (a terminal redraws every step)
        else:
            bar.label = label

    try:
        st = train_head(
            model,
            trainer,
            data["train"],
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
            start_step=start,
            batch_size=args.batch_size,
            loss=args.loss,
            candidates=args.candidates,
            negatives=args.negatives,
            time_limit=None if args.minutes is None else args.minutes * 60.0,
            states=states,
            held_out_states=held_states,
            held_out=data["held_out"],
            eval_every=args.save_every,
            progress=progress,
            checkpoint=save,
            checkpoint_every=args.save_every,
            name=command.name,
        )
    except ValueError as exc:  # e.g. no sequence long enough to train on
        raise TrainError(str(exc)) from exc
    bar.close()
    save(st["steps"], trainer.module)
    summary = {
        "out": str(out),
        "train_sequences": len(data["train"]),
        "held_out_sequences": len(data["held_out"]),
        "train_tokens": sum(len(s) for s in data["train"]),
        "prompts": data.get("prompts"),
        "held_out_prompts": data.get("held_out_prompts"),
        "resumed_at": start,
        "data_seconds": data_seconds,
        **st,
        "seconds": round(time.perf_counter() - t0, 1),
        "target": identity,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"{command.name}: {summary['train_sequences']} sequences ({summary['train_tokens']} "
        f"tokens), steps {start + 1}..{st['steps']}: loss {st['first_loss']:.3f} -> "
        f"{st['last_loss']:.3f}; first-draft agreement with the model: {st['top1']:.1%} on "
        f"the training text, {st['held_out_top1']:.1%} held out; {summary['seconds']} s"
        + (" (stopped by --minutes)" if st["stopped_by_time"] else "")
        + f"; head in {out}",
        file=sys.stderr,
    )
    print(command.usage(out))
    return 0


def held_out_acceptance(
    folder: str | Any,
    policy: Any,
    drafter: str,
    *,
    model: Any = None,
    max_tokens: int = 128,
) -> dict:
    """Per-position acceptance of a trained head on the prompts its training held out.

    The prompts are the ``held_out_prompt_ids`` of ``folder``'s ``train_data.json``
    (written by :func:`run_training` since core 0.2.7). Each one is generated greedily
    with ``policy`` (whose drafter ``drafter`` reports ``position_reached`` and
    ``position_accepted`` in its stats, as ``qwen_mtp`` and ``gemma4_mtp`` do; pass a
    fixed depth, ``adaptive = false``, to measure every position) and with plain
    decoding, and the outputs are compared.

    Args:
        folder: the trained head's folder.
        policy: the policy (a :class:`specdec.Policy`, a preset name, a TOML path or a
            dict) that drafts with the head.
        drafter: the name of the drafter whose per-position stats are summed.
        model: the target (a loaded mlx-lm model, a path, ``None``: the default model).
        max_tokens: tokens generated per prompt.

    Returns:
        ``{"prompts", "position_reached", "position_accepted", "position_acceptance",
        "conditional_acceptance", "tokens_per_forward", "identical"}``:
        ``position_reached[i]``: rounds that drafted position ``i + 1``;
        ``position_accepted[i]``: of those, how many accepted it (every earlier draft was
        accepted too); ``position_acceptance``: their ratio; ``conditional_acceptance[i]``:
        of the rounds that accepted position ``i`` (all rounds for the first), the share
        that accepted position ``i + 1`` too; ``identical``: every output equals plain
        decoding's.

    Raises:
        TrainError: ``train_data.json`` is missing or does not list its held-out prompts,
            or ``drafter`` reports no per-position stats.
    """
    import json
    from pathlib import Path

    path = Path(folder) / DATA_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot read {path}: {exc}") from exc
    prompts = data.get("held_out_prompt_ids") if isinstance(data, dict) else None
    if prompts is not None and not prompts:
        raise TrainError(f"{path} holds no prompt out (its held_out_prompt_ids is empty)")
    if not prompts:
        raise TrainError(
            f"{path} does not list its held-out prompts (held_out_prompt_ids, written by "
            "specdec train-head and train-assistant since specdec-core 0.2.7): run the "
            "training command again (--data FILE reuses a newer run's train_data.json)"
        )
    pipe = assemble(model, policy=policy)
    plain = assemble(pipe.model, tokenizer=pipe.tokenizer, policy="none")
    reached: list[int] = []
    accepted: list[int] = []
    forwards = tokens = 0
    identical = True
    for p in prompts:
        out = pipe.generate(p, max_tokens=max_tokens)
        ref = plain.generate(p, max_tokens=max_tokens)
        identical &= out.tokens == ref.tokens
        st = out.stats.per_drafter.get(drafter) or {}
        if "position_reached" not in st:
            raise TrainError(
                f"the drafter {drafter!r} reports no position_reached/position_accepted "
                f"stats (per_drafter has {sorted(out.stats.per_drafter)})"
            )
        for i, (r, a) in enumerate(zip(st["position_reached"], st["position_accepted"])):
            if i == len(reached):
                reached.append(0)
                accepted.append(0)
            reached[i] += r
            accepted[i] += a
        forwards += out.stats.target_forwards
        tokens += out.stats.generation_tokens
    return {
        "prompts": len(prompts),
        "position_reached": reached,
        "position_accepted": accepted,
        "position_acceptance": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "conditional_acceptance": [
            round(a / r, 4) if r else None for a, r in zip(accepted, [reached[0], *accepted[:-1]])
        ]
        if reached
        else [],
        "tokens_per_forward": round(tokens / forwards, 3) if forwards else None,
        "identical": identical,
    }
