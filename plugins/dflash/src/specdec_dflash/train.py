"""Self-distilling a DFlash drafter on the target's own text: the block loss and the
training loop of ``specdec train-dflash``.

The recipe is SpecForge's (``specforge/core/dflash.py``, aligned with the DFlash paper)
with ModelOpt's self-distillation loss (``hf_dflash.py``), see ``docs/notes/dflash.md``:

- **Blocks.** Anchors ``p`` drawn uniformly, without replacement, among the positions of
  a sequence with ``p + 1 <= S - 1`` (at least one token to predict); the block is
  ``[x[p], MASK x (B - 1)]`` at positions ``p .. p + B - 1``; it sees the context
  features of positions **before** ``p`` (the anchor's own features do not exist when
  drafting) and itself (no causal mask), never another block.
- **Loss.** Slot ``k >= 1`` is scored against the target's distribution at ``p + k - 1``
  (its next-token distribution for ``x[p + k]``): KL divergence (soft cross-entropy up
  to a constant), weighted by ``exp(-(k - 1) / gamma)``, a weighted mean over the slots
  whose token is in the sequence. Where the target's output layer is affine, the KL is
  over a candidate set (the target's ``candidates`` most likely tokens at every scored
  position plus ``negatives`` uniform tokens; specdec-train's ``sampled`` loss), else
  over the whole vocabulary.

What the target computed comes from one teacher-forced forward per sequence
(:func:`record_sequence`): the chosen layers' outputs, its final hidden states and its
most likely tokens. The target stays frozen; the drafter's embeddings and output layer
are the target's.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from specdec.heads import output_layer
from specdec.verifiers import HiddenStateVerifier

from .drafter import embeddings
from .model import DFlashConfig, DFlashModel

__all__ = [
    "DFlashTrainer",
    "SequenceRecord",
    "block_loss",
    "block_positions",
    "config_dict",
    "from_recorded",
    "new_dflash",
    "record_sequence",
    "save_dflash",
    "train_dflash",
]


# -- a new drafter and its checkpoint ----------------------------------------------------


def new_dflash(
    model: Any,
    *,
    layers: int = 1,
    block_size: int = 8,
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    seed: int = 0,
    init: str = "target",
) -> DFlashModel:
    """A new drafter for ``model``: draft layers shaped like the target's (its attention
    heads, head size, MLP width, RoPE base), ``fc`` reading the outputs of
    ``target_layer_ids``.

    Args:
        init: ``"target"``: each draft layer starts as a copy of one of the target's last
            decoder layers (the weights of the same name and shape, dequantized;
            ``q_norm`` / ``k_norm`` at one; a Gemma target's norms are not copied), the
            final norm as the target's, and ``fc`` passing the last id's features
            through (identity on their slice, zero elsewhere); ``"random"``: MLX's
            default initialisation (the published recipe trains from scratch).
    """
    from .checkpoint import target_shape

    if init not in ("target", "random"):
        raise ValueError(f"init must be 'target' or 'random', got {init!r}")
    inner = getattr(model, "language_model", model)
    args = inner.args
    hidden, n_target, vocab = target_shape(model)
    heads = int(args.num_attention_heads)
    cfg = DFlashConfig(
        hidden_size=int(hidden or args.hidden_size),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(getattr(args, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(args, "head_dim", None) or args.hidden_size // heads),
        intermediate_size=int(args.intermediate_size),
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        vocab_size=int(vocab or args.vocab_size),
        attention_bias=False,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(int(i) for i in target_layer_ids),
        num_target_layers=n_target,
    )
    mx.random.seed(seed)
    module = DFlashModel(cfg)
    if init == "target":
        _start_from_target(module, inner, layers)
    mx.eval(module.parameters())
    return module


def _dense_weight(mod: Any) -> mx.array | None:
    """A linear layer's weight as a dense float32 ``[out, in]`` (quantized ones
    dequantized), ``None`` for anything else."""
    if isinstance(mod, nn.QuantizedLinear):
        kw = {"mode": mod.mode} if getattr(mod, "mode", None) else {}
        w = mx.dequantize(
            mod.weight, mod.scales, getattr(mod, "biases", None), mod.group_size, mod.bits, **kw
        )
        return w.astype(mx.float32)
    if isinstance(mod, nn.Linear):
        return mod.weight.astype(mx.float32)
    return None


def _start_from_target(module: DFlashModel, inner: Any, layers: int) -> None:
    """``init="target"``: draft layer ``i`` from the target's layer ``N - layers + i``
    (every linear layer of the same name and shape, dequantized; the norms too, except
    for Gemma targets, whose norms scale by ``1 + w`` and sit elsewhere: theirs stay at
    one), the final norm, and ``fc`` passing the last conditioning layer through."""
    from mlx.utils import tree_flatten

    cfg = module.config
    mine = dict(tree_flatten(module.parameters()))
    backbone = inner.model
    gemma = str(getattr(inner, "model_type", "")).startswith("gemma")
    take: dict[str, mx.array] = {}
    for i, donor in enumerate(backbone.layers[-layers:]):
        for name, mod in donor.named_modules():
            w = _dense_weight(mod)
            if w is None and isinstance(mod, nn.RMSNorm) and not gemma:
                w = mod.weight.astype(mx.float32)
            key = f"layers.{i}.{name}.weight"
            if w is not None and key in mine and tuple(mine[key].shape) == tuple(w.shape):
                take[key] = w
    norm = getattr(getattr(backbone, "norm", None), "weight", None)
    if norm is not None and not gemma and tuple(norm.shape) == tuple(mine["norm.weight"].shape):
        take["norm.weight"] = norm.astype(mx.float32)
    H, k = cfg.hidden_size, len(cfg.target_layer_ids)
    take["fc.weight"] = mx.concatenate([mx.zeros((H, (k - 1) * H)), mx.eye(H)], axis=1)
    module.load_weights(list(take.items()), strict=False)


def config_dict(config: DFlashConfig) -> dict:
    """``config.json`` in the published layout (z-lab's drafters: a Qwen3 config with
    ``block_size``, ``num_target_layers`` and ``dflash_config``)."""
    c = config
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "vocab_size": c.vocab_size,
        "attention_bias": c.attention_bias,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
        },
    }


def save_dflash(
    folder: str | Path, module: DFlashModel, *, extra_config: dict | None = None
) -> Path:
    """Write ``module`` to ``folder`` in the published layout (``config.json``,
    ``model.safetensors``), with ``extra_config`` added to the config."""
    from mlx.utils import tree_flatten

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(module.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    cfg = {**config_dict(module.config), **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


# -- what the target computed ------------------------------------------------------------


class SequenceRecord:
    """What the target computed over one sequence (one teacher-forced forward).

    Attributes:
        tokens: ``[S]``.
        features: ``[S, k * H]``: the outputs of the drafter's target layers, in the
            model's dtype (what the verifier hands the drafter when it drafts).
        hidden: ``[S, H]`` float32: the final hidden states (after the final norm).
        top_ids: ``[S, c]``: the target's ``c`` most likely next tokens per position.
        top1: ``[S]``: its argmax per position.
        first: the first anchor blocks are drawn from (the last prompt token's position:
            blocks on the answer only, as SpecForge's loss mask; 0 when unknown).
    """

    __slots__ = ("tokens", "features", "hidden", "top_ids", "top1", "first")

    def __init__(self, tokens, features, hidden, top_ids, top1, first: int = 0) -> None:
        self.tokens, self.features, self.hidden = tokens, features, hidden
        self.top_ids, self.top1 = top_ids, top1
        self.first = first

    def anchors(self) -> range:
        """The positions a block may start at: ``first .. S - 2``."""
        return range(self.first, int(self.tokens.shape[0]) - 1)


def record_sequence(
    model: Any, seq: Sequence[int], layer_ids: Sequence[int], *, top_k: int = 8
) -> SequenceRecord:
    """One forward of ``model`` over ``seq`` through the ``hidden`` verifier (the path
    that feeds the drafter when it drafts)."""
    v = HiddenStateVerifier(layers=list(layer_ids))
    v.bind(model, layers=tuple(layer_ids))
    vr = v.verify(model, mx.array(list(seq)), make_prompt_cache(model))
    feats = mx.concatenate([vr.layers[i] for i in layer_ids], axis=-1)
    logits = vr.logits.astype(mx.float32)
    k = max(1, min(top_k, logits.shape[-1]))
    # a copy: a slice would keep the whole [S, V] partition alive
    top_ids = mx.contiguous(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
    rec = SequenceRecord(
        mx.array(list(seq)),
        feats,
        vr.hidden.astype(mx.float32),
        top_ids,
        mx.argmax(logits, axis=-1),
    )
    mx.eval(rec.tokens, rec.features, rec.hidden, rec.top_ids, rec.top1)
    return rec


def from_recorded(
    seq: Sequence[int], state: Any, layer_ids: Sequence[int]
) -> SequenceRecord | None:
    """A :class:`SequenceRecord` from what ``specdec_train.batch_answers`` recorded while
    the target wrote ``seq`` (``None`` when it lacks the outputs of ``layer_ids``). The
    last token of an answer was never fed, so the record may be one position short: the
    sequence is cut to it."""
    if state is None or any(i not in state.layers for i in layer_ids):
        return None
    n = min(len(seq), int(state.hidden.shape[0]))
    rec = SequenceRecord(
        mx.array(list(seq[:n])),
        mx.concatenate([state.layers[i][:n] for i in layer_ids], axis=-1),
        state.hidden[:n].astype(mx.float32),
        mx.contiguous(state.top_ids[:n]),
        state.top1[:n],
    )
    mx.eval(rec.tokens, rec.features, rec.hidden, rec.top_ids, rec.top1)
    return rec


# -- the block loss ----------------------------------------------------------------------


def block_positions(block: int, length: int, anchors: Sequence[int]) -> tuple:
    """For blocks at ``anchors`` of a sequence of ``length``: ``at`` ``[N, B - 1]`` (the
    position whose next-token distribution scores each slot, clamped into the sequence)
    and ``valid`` ``[N, B - 1]`` (1.0 where the slot's token is in the sequence)."""
    p = mx.array(list(anchors))
    pos = p[:, None] + mx.arange(1, block)[None]
    valid = (pos < length).astype(mx.float32)
    return mx.minimum(pos - 1, length - 1), valid


def _blocks(
    module: DFlashModel,
    embed: Callable[[mx.array], mx.array],
    features: mx.array,
    tokens: mx.array,
    anchors: Sequence[int],
) -> mx.array:
    """The draft's hidden states ``[N, B, H]`` for blocks at ``anchors``, each seeing the
    context before its anchor and the whole of itself."""
    c = module.config
    B, S = c.block_size, int(tokens.shape[0])
    p = mx.array(list(anchors))
    n = len(anchors)
    contexts = module.context(features[None], 0)  # every layer's K/V of 0 .. S-1
    slots = mx.arange(B)
    block_ids = mx.where(slots[None] == 0, tokens[p][:, None], c.mask_token_id)  # [N, B]
    ctx_ok = mx.arange(S)[None] < p[:, None]  # [N, S]
    mask = mx.concatenate([ctx_ok, mx.ones((n, B), dtype=mx.bool_)], axis=1)
    mask = mx.broadcast_to(mask[:, None, None, :], (n, 1, B, S + B))
    return module.forward(embed(block_ids), p, contexts, mask)


def _slot_weights(block: int, gamma: float) -> mx.array:
    return mx.exp(-(mx.arange(1, block).astype(mx.float32) - 1) / gamma)[None]


def _kl(teacher: mx.array, draft: mx.array) -> mx.array:
    lt = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
    ld = draft - mx.logsumexp(draft, axis=-1, keepdims=True)
    return (mx.exp(lt) * (lt - ld)).sum(axis=-1)


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
    """The weighted KL of one sequence's blocks over the whole vocabulary, and their
    slots' top-1 agreement with the target (``[B - 1]``).

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
    B, S = module.config.block_size, int(tokens.shape[0])
    hidden = _blocks(module, embed, features, tokens, anchors)
    at, valid = block_positions(B, S, anchors)
    teach = teacher[at]  # [N, B-1, V]
    draft = logits_of(hidden[:, 1:])
    w = _slot_weights(B, gamma) * valid
    loss = mx.sum(_kl(teach, draft) * w) / mx.maximum(mx.sum(w), 1e-9)
    agree = (mx.argmax(draft, axis=-1) == mx.argmax(teach, axis=-1)).astype(mx.float32) * valid
    return loss, mx.sum(agree, axis=0) / mx.maximum(mx.sum(valid, axis=0), 1.0)


# -- the trainer -------------------------------------------------------------------------


class DFlashTrainer:
    """A DFlash drafter and what its training reads of the target.

    Args:
        module: the drafter (trained in place).
        model: the target.
        gamma: the decay of the slot weights (the published recipe: 7 for blocks of 16,
            5 for 10, 4 for 8).
        anchors: blocks per sequence per step.
    """

    kv_layers: tuple = ()

    def __init__(self, module: DFlashModel, model: Any, *, gamma: float, anchors: int) -> None:
        from specdec_train import TargetOutput

        self.module = module
        self.embed = embeddings(model)
        self.out = TargetOutput(model)
        self.full = output_layer(model).logits
        self.gamma = gamma
        self.anchors = anchors
        self.layer_ids = tuple(module.config.target_layer_ids)
        #: read by specdec_train.run_training: the answers are recorded with these
        self.feature_layers = self.layer_ids

    def draft_logits(self, hidden: mx.array, ids: mx.array | None = None) -> mx.array:
        """The drafter's logits of ``hidden`` through the target's output layer (over
        ``ids`` only where given: an affine output layer)."""
        if ids is None:
            return self.full(hidden).astype(mx.float32)
        return self.out.logits(hidden, ids)

    def teacher_logits(self, rec: SequenceRecord, at: mx.array, ids: mx.array | None) -> mx.array:
        h = rec.hidden[at].astype(mx.float32)
        return self.draft_logits(h, ids)

    def loss(
        self,
        module: DFlashModel,
        batch: Sequence[tuple[SequenceRecord, list[int]]],
        ids: mx.array | None,
    ) -> mx.array:
        """The weighted KL over a minibatch of ``(record, anchors)`` (over ``ids`` or
        the whole vocabulary)."""
        total = mx.array(0.0)
        weight = mx.array(0.0)
        B = module.config.block_size
        for rec, anchors in batch:
            S = int(rec.tokens.shape[0])
            hidden = _blocks(
                module, self.embed, rec.features.astype(mx.float32), rec.tokens, anchors
            )
            at, valid = block_positions(B, S, anchors)
            kl = _kl(
                mx.stop_gradient(self.teacher_logits(rec, at, ids)),
                self.draft_logits(hidden[:, 1:], ids),
            )
            w = _slot_weights(B, self.gamma) * valid
            total = total + mx.sum(kl * w)
            weight = weight + mx.sum(w)
        return total / mx.maximum(weight, 1e-9)

    def positions(self, records: Sequence[SequenceRecord], per_sequence: int = 64) -> list[float]:
        """Greedy acceptance per block position on ``records``: of blocks at up to
        ``per_sequence`` evenly spread anchors per sequence (on its answer where the
        prompt's length is known), the share whose drafts
        ``1 .. k`` all equal the target's argmax (``B - 1`` values)."""
        B = self.module.config.block_size
        reached = np.zeros(B - 1)
        accepted = np.zeros(B - 1)
        for rec in records:
            S = int(rec.tokens.shape[0])
            usable = rec.anchors()
            if not len(usable):
                continue
            step = max(1, len(usable) // per_sequence)
            anchors = list(usable[::step])[:per_sequence]
            hidden = _blocks(
                self.module, self.embed, rec.features.astype(mx.float32), rec.tokens, anchors
            )
            at, valid = block_positions(B, S, anchors)
            pred = mx.argmax(self.draft_logits(hidden[:, 1:]), axis=-1)
            ok = (pred == rec.top1[at]).astype(mx.float32) * valid
            run = np.cumprod(np.asarray(ok), axis=1)
            reached += np.asarray(valid).sum(axis=0)
            accepted += run.sum(axis=0)
        return [round(float(a / r), 4) if r else float("nan") for a, r in zip(accepted, reached)]


def train_dflash(
    model: Any,
    trainer: DFlashTrainer,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int = 300,
    lr: float = 1e-3,
    seed: int = 0,
    start_step: int = 0,
    batch_size: int = 8,
    loss: str = "auto",
    candidates: int = 8,
    negatives: int = 1024,
    warmup: int = 20,
    time_limit: float | None = None,
    states: Any = None,
    held_out_states: Any = None,
    held_out: Sequence[Sequence[int]] = (),
    eval_every: int = 0,
    progress: Callable[[int, int, float, float | None], None] | None = None,
    checkpoint: Callable[[int, Any], None] | None = None,
    checkpoint_every: int = 0,
    name: str = "train-dflash",
    on_prepare: Callable[[int, int], None] | None = None,
    prompt_lengths: Sequence[int] | None = None,
    held_out_prompt_lengths: Sequence[int] | None = None,
) -> dict:
    """Fit ``trainer.module`` to ``model``'s distribution over blocks of ``sequences``:
    ``specdec_train.train_head``'s arguments and result (a ``TrainCommand.train``).

    A step is ``batch_size`` sequences (a seeded shuffled order, epoch after epoch), each
    with ``trainer.anchors`` blocks at random anchors; AdamW (no weight decay), linear
    warm-up over ``warmup`` steps then cosine decay to a tenth, gradients clipped to norm
    1. ``states`` and ``held_out_states`` (``specdec_train.Recorded``, as
    ``batch_answers`` records them with ``layers``) give what the target computed; a
    sequence without one (or without the outputs of the drafter's target layers) is
    recorded here, one forward (``on_prepare(done, total)`` after each).
    ``prompt_lengths`` / ``held_out_prompt_lengths`` (how many leading tokens of each
    sequence are its prompt, as ``run_training`` gives them) put the blocks on the answers
    only, from the prompt's last token on (SpecForge's loss mask), in training and in the
    acceptance figures; ``None``: anywhere. A resumed run
    (``start_step``) continues the seeded stream of minibatches, anchors and negatives
    (the first ``start_step`` steps' draws are replayed); the optimizer's moments start
    afresh, as ``train_head``'s do.

    Returns:
        ``train_head``'s keys (``top1`` / ``held_out_top1``: the first draft's greedy
        acceptance; ``top1`` on the first 32 training sequences) and ``position_acceptance`` / ``held_out_position_acceptance``: the
        greedy acceptance per block position (drafts ``1 .. k`` all right).

    Raises:
        ValueError: no sequence of 3 or more tokens, ``steps <= start_step``, a bad
            ``loss``, ``batch_size``, ``candidates`` or ``negatives``, or
            ``loss="sampled"`` for an output layer that is not affine.
    """
    import mlx.optimizers as optim

    for label, v, lo in (("batch_size", batch_size, 1), ("candidates", candidates, 1)):
        if v < lo:
            raise ValueError(f"{name}: {label} must be >= {lo}, got {v}")
    if negatives < 0:
        raise ValueError(f"{name}: negatives must be >= 0, got {negatives}")

    seqs = [list(s) for s in sequences if len(s) >= 3]
    if not seqs:
        raise ValueError(f"{name}: give at least one sequence of 3 or more tokens")
    if steps < 1 or steps <= start_step:
        raise ValueError(
            f"{name}: steps must be >= 1 and above start_step ({start_step}), got {steps}"
        )
    if loss not in ("auto", "sampled", "full"):
        raise ValueError(f"{name}: loss must be auto, sampled or full, got {loss!r}")
    if loss == "sampled" and not trainer.out.affine:
        raise ValueError(
            f"{name}: loss 'sampled' needs an affine output layer and this model's is not "
            "(e.g. soft-capped logits); use 'full' or 'auto'"
        )
    sampled = trainer.out.affine and loss != "full"
    if states is not None and len(states) != len(sequences):
        raise ValueError(f"{name}: {len(states)} states for {len(sequences)} sequences")
    if held_out_states is not None and len(held_out_states) != len(held_out):
        raise ValueError(
            f"{name}: {len(held_out_states)} states for {len(held_out)} held-out sequences"
        )
    t_prepare = time.perf_counter()
    every = [
        (list(s), None if sts is None else sts[i], 0 if lens is None else lens[i])
        for group, sts, lens in (
            (sequences, states, prompt_lengths),
            (held_out, held_out_states, held_out_prompt_lengths),
        )
        for i, s in enumerate(group)
        if len(s) >= 3
    ]
    records = []
    for i, (s, st, n_prompt) in enumerate(every):
        rec = from_recorded(s, st, trainer.layer_ids)
        if rec is None or int(rec.tokens.shape[0]) < 3:
            rec = record_sequence(model, s, trainer.layer_ids, top_k=candidates)
        # blocks on the answer: the first anchor is the prompt's last token
        rec.first = max(0, min(n_prompt - 1, int(rec.tokens.shape[0]) - 2))
        records.append(rec)
        if on_prepare is not None:
            on_prepare(i + 1, len(every))
    data, held = records[: len(seqs)], records[len(seqs) :]
    prepare_seconds = time.perf_counter() - t_prepare
    module = trainer.module
    module.train()
    rng = random.Random(seed)
    nprng = np.random.default_rng(seed)
    mx.random.seed(seed)
    opt = optim.AdamW(learning_rate=lr, weight_decay=0.0)
    grad = nn.value_and_grad(module, trainer.loss)
    vocab = trainer.out.vocab
    order: list[int] = []
    B = module.config.block_size

    def draw() -> tuple[list, mx.array | None]:
        """The next step's ``(record, anchors)`` pairs and candidate ids."""
        nonlocal order
        batch = []
        for _ in range(min(batch_size, len(data))):
            if not order:
                order = list(range(len(data)))
                rng.shuffle(order)
            rec = data[order.pop()]
            usable = rec.anchors()
            batch.append((rec, sorted(rng.sample(usable, min(trainer.anchors, len(usable))))))
        negs = nprng.integers(0, vocab, size=negatives) if sampled and negatives else None
        if not sampled:
            return batch, None
        cand = [
            np.asarray(rec.top_ids[block_positions(B, int(rec.tokens.shape[0]), a)[0]]).reshape(-1)
            for rec, a in batch
        ]
        if negs is not None:
            cand.append(negs)
        return batch, mx.array(np.unique(np.concatenate(cand)).astype(np.int32))

    for _ in range(start_step):  # a resumed run continues the same stream
        draw()
    t0 = time.perf_counter()

    def lr_at(step: int) -> float:
        warm = min(1.0, step / max(1, warmup))
        frac = min(1.0, (step - 1) / max(1, steps - 1))
        if time_limit:
            frac = max(frac, min(1.0, (time.perf_counter() - t0) / time_limit))
        return lr * warm * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))

    first = last = None
    held_top = None
    done = start_step
    stopped_by_time = False
    for i in range(start_step, steps):
        step = i + 1
        batch, ids = draw()
        opt.learning_rate = lr_at(step)
        value, grads = grad(module, batch, ids)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(module, grads)
        mx.eval(module.parameters(), opt.state, value)
        last = float(value)
        first = last if first is None else first
        done = step
        if held and eval_every and (step % eval_every == 0 or step == steps):
            module.eval()
            held_top = trainer.positions(held)
            module.train()
        if progress is not None:
            progress(step, steps, last, None if held_top is None else held_top[0])
        if checkpoint is not None and checkpoint_every and step % checkpoint_every == 0:
            checkpoint(step, module)
        if time_limit is not None and time.perf_counter() - t0 >= time_limit and step < steps:
            stopped_by_time = True
            break
    train_seconds = time.perf_counter() - t0
    module.eval()
    if held and (held_top is None or stopped_by_time or done % max(1, eval_every)):
        held_top = trainer.positions(held)
    mine = trainer.positions(data[:32])  # the training text: its first 32 sequences
    return {
        "steps": done,
        "first_loss": first,
        "last_loss": last,
        "loss": "sampled" if sampled else "full",
        "top1": mine[0],
        "held_out_top1": None if held_top is None else held_top[0],
        "position_acceptance": mine,
        "held_out_position_acceptance": held_top,
        "train_seconds": round(train_seconds, 1),
        "prepare_seconds": round(prepare_seconds, 1),
        "stopped_by_time": stopped_by_time,
    }
