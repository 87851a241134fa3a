"""Train a Gemma-4-style assistant for any mlx-lm model, with specdec-train's loop.

The loop, the losses, the recording of the target's states (and of the K/V the
assistant reads) are :mod:`specdec_train`'s, shared with ``specdec train-head``;
this module is what is particular to the assistant: :class:`AssistantTrainer` (its
inputs, its forward over whole sequences at once, its own output layer and its extra
losses), :func:`new_assistant` (an assistant shaped for a target) and
:func:`train_assistant`.

Training matches drafting position by position. For each ``t`` the assistant reads
``x[t+1]`` and the target's hidden state ``h_t``; its attention reads the target's K/V
of positions ``0 .. t`` (a sliding layer: the last ``window`` of them), with its queries
at position ``t+1`` (``position="bonus"``) or ``t`` (``"last"``), and its logits are
distilled from the target's distribution over ``x[t+2]``. Two further terms train what
the first draft does not use: ``post_projection``'s output is pulled to the target's
next hidden state ``h_{t+1}`` (the next step's input), and the centroid scores of an
assistant with the masked embedder learn which cluster holds the target's next token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import specdec
import specdec_train

from .assistant import AssistantConfig, Gemma4Assistant
from .target import TargetBinding, bind_target, text_model


def cluster_vocabulary(
    embeddings: Any, clusters: int, *, iters: int = 8, seed: int = 0
) -> np.ndarray:
    """A ``token_ordering`` for the masked embedder: the vocabulary in ``clusters``
    clusters of equal size (``vocab / clusters`` tokens), cluster after cluster.

    Spherical k-means over the embedding rows, then a balanced assignment: tokens are
    placed in order of how strongly they prefer their best cluster, each into the best
    cluster that still has room.
    """
    e = np.asarray(
        embeddings.astype(mx.float32) if isinstance(embeddings, mx.array) else embeddings
    )
    e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-6)
    V = e.shape[0]
    if V % clusters:
        raise ValueError(
            f"cluster_vocabulary: {V} tokens do not split into {clusters} equal clusters"
        )
    size = V // clusters
    rng = np.random.default_rng(seed)
    cent = e[rng.choice(V, clusters, replace=False)]
    for _ in range(iters):
        assign = np.argmax(e @ cent.T, axis=1)
        for c in range(clusters):
            members = e[assign == c]
            if len(members):
                v = members.sum(axis=0)
                cent[c] = v / max(np.linalg.norm(v), 1e-6)
    scores = e @ cent.T
    order = np.argsort(-(scores.max(axis=1) - scores.mean(axis=1)), kind="stable")
    room = np.full(clusters, size)
    out: list[list[int]] = [[] for _ in range(clusters)]
    for tok in order:
        for c in np.argsort(-scores[tok]):
            if room[c]:
                out[c].append(int(tok))
                room[c] -= 1
                break
    return np.array([t for c in out for t in c], dtype=np.int32)


def new_assistant(
    model: Any,
    *,
    hidden_size: int | None = None,
    intermediate_size: int | None = None,
    layers: Sequence[str] | int = 1,
    heads: int | None = None,
    block_size: int = 4,
    centroids: int = 0,
    top_k_centroids: int = 32,
    seed: int = 0,
) -> tuple[Gemma4Assistant, TargetBinding]:
    """An untrained assistant shaped for ``model`` and the binding to it.

    Args:
        hidden_size: the assistant's width (``None``: the target's; then its tied
            embeddings and final norm start as the target's, so its first logits are
            the target's head on its state).
        intermediate_size: the MLP width (``None``: ``2 * hidden_size``).
        layers: the layer types (a list of ``"sliding_attention"`` / ``"full_attention"``)
            or a count (that many layers of the target's last layer type).
        heads: query heads (``None``: the donor layers' query heads, else 4).
        block_size: drafts per round plus one, written to the config.
        centroids: ``0``: a dense tied head; else the number of clusters of a
            centroid-masked embedder (the vocabulary must split into them evenly).
        top_k_centroids: clusters scored per step by the masked embedder.
        seed: the initialisation seed.
    """
    tm = text_model(model)
    args = tm.args
    H = int(args.hidden_size)
    V = int(specdec.heads.model_vocab_size(tm))
    types_avail = tuple(getattr(args, "layer_types", None) or ())
    if isinstance(layers, int):
        last = types_avail[-1] if types_avail else "full_attention"
        n_shared = int(getattr(args, "num_kv_shared_layers", 0) or 0)
        owning = types_avail[: len(tm.model.layers) - n_shared] if types_avail else ()
        if owning:
            last = owning[-1]
        layers = [last] * layers
    layers = tuple(layers)
    if centroids and not 1 <= top_k_centroids <= centroids:
        raise ValueError(
            f"new_assistant: top_k_centroids must be in 1..centroids ({centroids}), got "
            f"{top_k_centroids}"
        )
    # head sizes from the donors
    from .target import _attn

    donor_hd = {}
    donor_heads = {}
    for i, lyr in enumerate(tm.model.layers):
        t = types_avail[i] if types_avail else "full_attention"
        a = _attn(lyr)
        donor_hd[t] = int(getattr(a, "head_dim", 0) or 0)
        donor_heads[t] = int(getattr(a, "n_heads", 0) or getattr(a, "num_attention_heads", 0) or 4)
    hd = donor_hd.get("sliding_attention") or donor_hd.get("full_attention")
    ghd = donor_hd.get("full_attention") or hd
    Hd = int(hidden_size or H)
    cfg = AssistantConfig(
        backbone_hidden_size=H,
        hidden_size=Hd,
        intermediate_size=int(intermediate_size or 2 * Hd),
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=int(heads or donor_heads.get(layers[0], 4)),
        head_dim=hd,
        global_head_dim=ghd,
        sliding_window=int(getattr(args, "sliding_window", 0) or 512),
        vocab_size=V,
        rms_norm_eps=float(getattr(args, "rms_norm_eps", 1e-6)),
        use_ordered_embeddings=bool(centroids),
        num_centroids=int(centroids or 2048),
        centroid_intermediate_top_k=int(top_k_centroids if centroids else 32),
        block_size=block_size,
    )
    binding = bind_target(model, cfg)  # the pair is checked before any weight is made
    mx.random.seed(seed)
    module = Gemma4Assistant(cfg)
    # Small residual branches: the assistant starts near "pre_projection, norm, head".
    for layer in module.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * 0.1
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.1
    emb = tm.model.embed_tokens
    if Hd == H and hasattr(emb, "weight") and not hasattr(emb, "scales"):
        w = emb.weight.astype(mx.float32)
        module.model.embed_tokens.weight = w
        norm = getattr(tm.model, "norm", None)
        if getattr(norm, "weight", None) is not None:
            module.model.norm.weight = norm.weight.astype(mx.float32)
        # pre_projection starts as "take h" (the embedding half small), post_projection
        # as the identity: the first logits are the target's own head on h_t.
        pre = mx.concatenate([mx.random.normal((H, H)) * 0.01, mx.eye(H)], axis=1)
        module.pre_projection.weight = pre
        module.post_projection.weight = mx.eye(H)
    if centroids:
        e = module.model.embed_tokens.weight
        ordering = cluster_vocabulary(e, centroids, seed=seed)
        module.masked_embedding.token_ordering = mx.array(ordering)
        table = np.asarray(e.astype(mx.float32))[ordering].reshape(centroids, -1, Hd).mean(axis=1)
        module.masked_embedding.centroids.weight = mx.array(table)
    mx.eval(module.parameters())
    return module, binding


def _causal_masks(L: int, window: int | None) -> mx.array:
    """``[L, L]`` boolean: query ``t`` attends keys ``s <= t`` (and ``s > t - window``)."""
    t = mx.arange(L)[:, None]
    s = mx.arange(L)[None, :]
    m = s <= t
    if window:
        m = m & (s > t - window)
    return m


class AssistantTrainer:
    """The Gemma 4 assistant for :func:`specdec_train.train_head`.

    Args:
        module: the assistant (trained in place).
        binding: its binding to the target (:func:`specdec_gemma4_mtp.target.bind_target`).
        position: ``"bonus"`` or ``"last"``: the queries' RoPE position, as the drafter's
            option of that name.
        next_weight: the weight of ``post_projection``'s error against ``h_{t+1}``
            (relative squared error).
        centroid_weight: the weight of the centroid scores' cross-entropy against the
            cluster of the target's argmax (assistants with the masked embedder).
    """

    def __init__(
        self,
        module: Gemma4Assistant,
        binding: TargetBinding,
        *,
        position: str = "bonus",
        next_weight: float = 1.0,
        centroid_weight: float = 0.5,
    ) -> None:
        self.module = module
        self.binding = binding
        self.position = position
        self.next_weight = next_weight
        self.centroid_weight = centroid_weight
        cfg = module.config
        self.types = tuple(dict.fromkeys(cfg.layer_types))
        self.kv_layers = tuple(binding.donors[t].layer for t in self.types)
        self.windows = {
            t: (cfg.sliding_window if t == "sliding_attention" else None) for t in self.types
        }
        self.cluster_of = None
        if cfg.use_ordered_embeddings:
            order = np.asarray(module.masked_embedding.token_ordering)
            per = cfg.vocab_size // cfg.num_centroids
            c = np.empty(cfg.vocab_size, dtype=np.int32)
            c[order] = np.arange(cfg.vocab_size) // per
            self.cluster_of = mx.array(c)

    def example(self, model: Any, seq: Sequence[int], rec: specdec_train.Recorded) -> dict:
        n = len(seq) - 2
        toks = mx.array(list(seq[1:-1]))
        out = {
            "emb": self.binding.embed_tokens(toks).astype(mx.float32),
            "hid": rec.hidden[:n],
            "nxt_top1": rec.top1[1 : n + 1],
        }
        for t in self.types:
            keys, values = rec.kv[self.binding.donors[t].layer]  # in the model's dtype
            out[f"k_{t}"] = keys[:n]
            out[f"v_{t}"] = values[:n]
        return out

    def _states(self, module: Gemma4Assistant, batch: Mapping[str, mx.array]) -> tuple:
        L = batch["emb"].shape[1]
        dt = batch["emb"].dtype
        kv = {
            t: (
                batch[f"k_{t}"].transpose(0, 2, 1, 3).astype(dt),
                batch[f"v_{t}"].transpose(0, 2, 1, 3).astype(dt),
            )
            for t in self.types
        }
        masks = {t: _causal_masks(L, self.windows[t]) for t in self.types}
        ropes = {t: self.binding.donors[t].rope for t in self.types}
        scales = {t: self.binding.donors[t].scale for t in self.types}
        offset = 1 if self.position == "bonus" else 0
        return module.hidden(batch["emb"], batch["hid"], kv, ropes, offset, scales, masks)

    def forward(self, module: Gemma4Assistant, batch: Mapping[str, mx.array]) -> mx.array:
        return self._states(module, batch)[0]

    def logits(self, module: Gemma4Assistant, o: mx.array, ids: mx.array | None = None) -> mx.array:
        w = module.model.embed_tokens.weight
        z = o @ (w if ids is None else w[ids]).T
        cap = module.config.final_logit_softcapping
        return mx.tanh(z / cap) * cap if cap else z

    def eval_logits(self, module: Gemma4Assistant, o: mx.array) -> mx.array:
        """The logits the drafter drafts from (the masked embedder's where it has one):
        what held-out agreement is measured with."""
        B, L, H = o.shape
        return module.logits(o.reshape(B * L, H)).reshape(B, L, -1)

    def extra_loss(
        self, module: Gemma4Assistant, batch: Mapping[str, mx.array], o: mx.array
    ) -> mx.array:
        target = batch["nxt"]
        d = module.post_projection(o) - target  # the next step's h, as the drafter makes it
        scale = mx.maximum((target * target).mean(axis=-1), 1e-2)  # padded rows are zero
        loss = self.next_weight * (d * d).mean(axis=-1) / scale * batch["valid"]
        if self.cluster_of is not None and self.centroid_weight:
            scores = module.masked_embedding.centroids(o)
            want = self.cluster_of[batch["nxt_top1"]]
            loss = loss + self.centroid_weight * nn.losses.cross_entropy(scores, want)
        return loss


def train_assistant(
    model: Any,
    sequences: Sequence[Sequence[int]],
    *,
    init: Gemma4Assistant | None = None,
    position: str = "bonus",
    steps: int = 300,
    lr: float = 3e-3,
    seed: int = 0,
    **kwargs: Any,
) -> tuple[Gemma4Assistant, dict]:
    """Train an assistant for ``model`` on ``sequences`` (the model's own text).

    Args:
        init: an assistant to train in place (``None``: :func:`new_assistant` with its
            defaults).
        position: the queries' RoPE position convention it is trained for.
        steps, lr, seed, kwargs: :func:`specdec_train.train_head`'s (``batch_size``,
            ``loss``, ``held_out``, ``time_limit``, ``progress``, ...).

    Returns:
        the assistant and the training summary (``top1``: first-draft agreement on the
        training text; ``held_out_top1`` with ``held_out``).
    """
    if init is None:
        init, binding = new_assistant(model, seed=seed)
    else:
        binding = bind_target(model, init.config)
    trainer = AssistantTrainer(init, binding, position=position)
    st = specdec_train.train_head(
        model, trainer, sequences, steps=steps, lr=lr, seed=seed, name="train_assistant", **kwargs
    )
    st["params"] = init.n_params()
    st["position"] = position
    if not math.isfinite(st["last_loss"] or 0.0):
        raise ValueError(f"train_assistant: the loss diverged ({st['last_loss']}); lower lr")
    return init, st
