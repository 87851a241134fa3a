"""Train an MTP head for a model on its own distribution (the target stays frozen).

The head learns ``x[t+2]`` from ``(h_t, x[t+1])`` exactly as ``qwen_mtp`` drafts with
it: ``h_t`` is the target's hidden state after its final norm and the logits come from
the target's own output path. The labels are the target's own next-token
distribution at ``t+1``: self-distillation. Trained on text the target wrote itself,
the head learns to propose what the target would say.

The loss (``loss="sampled"``, the default where the output path is affine, as it is for
every tied or untied ``lm_head`` without soft-capping) never forms the logits of the
whole vocabulary, which cost several times the head itself on a large vocabulary:

- the KL divergence between the target's and the head's distributions restricted to
  a candidate set: the target's ``candidates`` most likely tokens at every position
  of the batch plus ``negatives`` tokens drawn uniformly (both distributions are
  exact on that set, since the target's logits there are ``W_U h_{t+1}``);
- plus ``mse_weight`` times the squared logit error over the *whole* vocabulary,
  ``||W (o - h_{t+1})||^2 / V``, computed through the output layer's Gram matrix
  ``W^T W`` (``H x H``) at the cost of a hidden-size product: it keeps the tokens
  outside the candidate set where the target has them.

``loss="full"`` (the fallback for an output path that is not affine, e.g. Gemma's
soft-capping) scores the full-vocabulary KL divergence.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import specdec

from .mtp import QwenMTP, text_model

LOSSES = ("auto", "sampled", "full")


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


class OutputLayer:
    """The target's output path as ``logits = h @ W.T + b`` (``W``: ``[V, H]``), read
    through the core's :func:`specdec.output_layer` (one per model, shared with draft
    heads): the layer's rows, dequantized, with a logit scale folded in.

    :attr:`affine` says whether the path really is affine (nothing but a scale after
    the layer; soft-capping is not); only then are :attr:`weight`, :attr:`bias` and
    :attr:`gram` (``W.T @ W``, built on first use) there.
    """

    def __init__(self, model: Any):
        try:
            layer = specdec.output_layer(model)
        except specdec.ModelLoadError:  # an output path the core cannot read as rows
            layer = None
        post = None if layer is None else layer.post
        self.affine = layer is not None and (post is None or post[0] in ("mul", "div"))
        self.vocab = int(layer.vocab_size if layer is not None else specdec.model_vocab_size(model))
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


class States:
    """What the target computed over one sequence: its hidden states ``[n, H]`` (after
    the final norm) and, from its logits, the ``k`` most likely token ids ``[n, k]`` and
    the argmax ``[n]`` at each of the first ``n`` positions (``n >= len(seq) - 1``)."""

    __slots__ = ("hidden", "top_ids", "top1")

    def __init__(self, hidden: mx.array, top_ids: mx.array, top1: mx.array) -> None:
        self.hidden, self.top_ids, self.top1 = hidden, top_ids, top1

    @classmethod
    def of(cls, hidden: mx.array, logits: mx.array, k: int) -> States:
        """From hidden states and logits ``[n, V]``."""
        logits = logits.astype(mx.float32)
        k = max(1, min(k, logits.shape[-1]))
        ids = mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k]
        return cls(hidden.astype(mx.float32), ids, mx.argmax(logits, axis=-1))


class _Example:
    """One sequence's training inputs: embeddings of x[t+1], h_t, and the target's state
    h_{t+1} (whose logits are its distribution over x[t+2])."""

    __slots__ = ("emb", "hid", "nxt", "top_ids", "target_top1", "n")

    def __init__(
        self, model: Any, seq: Sequence[int], candidates: int, states: States | None = None
    ) -> None:
        if states is None:  # one teacher-forced forward over the sequence
            states = States.of(*_target(model, seq), candidates)
        L = len(seq)
        toks = mx.array(list(seq))
        self.emb = mx.stop_gradient(
            text_model(model).model.embed_tokens(toks[1:-1]).astype(mx.float32)
        )
        h = states.hidden
        self.hid = h[: L - 2]
        self.nxt = h[1 : L - 1]
        # The target's distribution over x[t+2] is its output at t+1.
        self.target_top1 = states.top1[1 : L - 1]
        self.top_ids = states.top_ids[1 : L - 1, :candidates]
        self.n = L - 2
        mx.eval(self.emb, self.hid, self.nxt, self.target_top1, self.top_ids)


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
        total += ex.n
    return right / total if total else float("nan")


def _batch(exs: Sequence[_Example]) -> dict:
    """Right-padded ``[B, L, ...]`` arrays and the mask of real positions (the head's
    attention is causal, so padding at the end changes no real position)."""
    L = max(ex.n for ex in exs)

    def pad(a: mx.array) -> mx.array:
        extra = L - a.shape[0]
        return a if not extra else mx.pad(a, [(0, extra)] + [(0, 0)] * (a.ndim - 1))

    valid = mx.array([[i < ex.n for i in range(L)] for ex in exs])
    return {
        "emb": mx.stack([pad(ex.emb) for ex in exs]),
        "hid": mx.stack([pad(ex.hid) for ex in exs]),
        "nxt": mx.stack([pad(ex.nxt) for ex in exs]),
        "valid": valid.astype(mx.float32),
        "top_ids": [ex.top_ids for ex in exs],
    }


def _kl(target_logits: mx.array, logits: mx.array) -> mx.array:
    """KL(target || head) per position over the last axis."""
    lt = target_logits - mx.logsumexp(target_logits, axis=-1, keepdims=True)
    lh = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return (mx.exp(lt) * (lt - lh)).sum(axis=-1)


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
    states: Sequence[States | None] | None = None,
    held_out_states: Sequence[States | None] | None = None,
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
        states: the target's :class:`States` over each sequence (as
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
    seqs = [list(s) for s in sequences if len(s) >= 3]
    if not seqs:
        raise ValueError("train_mtp_head: give at least one sequence of 3 or more tokens")
    if steps < 1 or steps <= start_step:
        raise ValueError(
            f"train_mtp_head: steps must be >= 1 and above start_step ({start_step}), got {steps}"
        )
    if loss not in LOSSES:
        raise ValueError(f"train_mtp_head: loss must be one of {LOSSES}, got {loss!r}")
    for name, v, lo in (("batch_size", batch_size, 1), ("candidates", candidates, 1)):
        if v < lo:
            raise ValueError(f"train_mtp_head: {name} must be >= {lo}, got {v}")
    if negatives < 0:
        raise ValueError(f"train_mtp_head: negatives must be >= 0, got {negatives}")
    taps = specdec.model_taps(model)
    out = OutputLayer(model)
    if loss == "auto":
        loss = "sampled" if out.affine else "full"
    elif loss == "sampled" and not out.affine:
        raise ValueError(
            "train_mtp_head: loss 'sampled' needs an affine output layer and this model's "
            "is not (e.g. soft-capped logits); use 'full' or 'auto'"
        )
    if states is not None and len(states) != len(sequences):
        raise ValueError(f"train_mtp_head: {len(states)} states for {len(sequences)} sequences")
    data = [
        _Example(model, s, candidates, None if states is None else states[i])
        for i, s in enumerate(sequences)
        if len(s) >= 3
    ]
    if held_out_states is not None and len(held_out_states) != len(held_out):
        raise ValueError(
            f"train_mtp_head: {len(held_out_states)} states for {len(held_out)} held-out sequences"
        )
    held = [
        _Example(model, s, 1, None if held_out_states is None else held_out_states[i])
        for i, s in enumerate(held_out)
        if len(s) >= 3
    ]
    mx.random.seed(seed)
    head = init if init is not None else QwenMTP(model, layers)
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

    def sampled_loss(m: QwenMTP, b: dict, ids: mx.array) -> mx.array:
        o = m(b["emb"], b["hid"], [None] * len(m.layers))
        valid = b["valid"]
        kl = _kl(out.logits(b["nxt"], ids), out.logits(o, ids))
        d = o - b["nxt"]
        mse = ((d @ out.gram) * d).sum(axis=-1) / vocab
        return ((kl + mse_weight * mse) * valid).sum() / valid.sum()

    def full_loss(m: QwenMTP, b: dict) -> mx.array:
        o = m(b["emb"], b["hid"], [None] * len(m.layers))
        valid = b["valid"]
        kl = _kl(taps.head(b["nxt"]).astype(mx.float32), taps.head(o).astype(mx.float32))
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
            held_top1 = agreement(model, head, held)
        if progress is not None:
            progress(step, steps, last, held_top1)
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0:
            checkpoint(step, head)
        if time_limit is not None and time.perf_counter() - t0 >= time_limit and step < steps:
            stopped_by_time = True
            break
    head.eval()
    if held and (held_top1 is None or stopped_by_time or done % max(1, eval_every)):
        held_top1 = agreement(model, head, held)
    return head, {
        "steps": done,
        "first_loss": first,
        "last_loss": last,
        "loss": loss,
        "top1": agreement(model, head, data),
        "held_out_top1": held_top1,
        "train_seconds": round(time.perf_counter() - t0, 1),
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
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[list[int]], list[States] | None] | None:
    """The model's answers to ``prompts`` (token lists, without the prompt), decoded in
    left-padded batches through mlx-lm's ``BatchKVCache``: many times faster than one
    prompt at a time on a CPU. Greedy at ``temperature`` 0, else sampled. An answer stops
    after an ``eos`` token (kept out).

    Args:
        record: also return the target's :class:`States` over each ``prompt + answer``
            with this many top token ids per position (the forwards that wrote the
            answers computed them: no second pass); 0: ``None`` instead.

    Returns:
        ``(answers, states)``, or ``None`` for a model whose caches are not all plain
        K/V caches (linear-attention layers): answer those one by one.
    """
    if not _plain_cache_only(model):
        return None
    from mlx_lm.models.cache import BatchKVCache

    taps = specdec.model_taps(model) if record else None
    n_layers = len(text_model(model).model.layers)
    stop = set(int(t) for t in eos)
    key = mx.random.key(seed)
    answers: list[list[int]] = []
    states: list[States] = []
    for start in range(0, len(prompts), batch_size):
        group = [list(p) for p in prompts[start : start + batch_size]]
        width = max(len(p) for p in group)
        pads = [width - len(p) for p in group]
        x = mx.array([[0] * pad + p for pad, p in zip(pads, group)])
        cache = [BatchKVCache(pads) for _ in range(n_layers)]
        outs: list[list[int]] = [[] for _ in group]
        alive = [True] * len(group)
        steps: list[tuple[mx.array, mx.array, mx.array]] = []  # per forward: h, ids, top1
        for _ in range(max_tokens):
            if taps is not None:
                with taps.recording() as rec:
                    out = model(x, cache=cache)
                st = States.of(
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
                states.append(States(h[r, pad:end], ids[r, pad:end], top1[r, pad:end]))
            mx.eval([(s.hidden, s.top_ids, s.top1) for s in states[-len(group) :]])
        if on_batch is not None:
            on_batch(len(group))
    return answers, (states if taps is not None else None)
