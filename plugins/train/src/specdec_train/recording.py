"""What the target computed: its hidden states, its most likely next tokens and the K/V of
chosen caches over a sequence (:func:`record`, one teacher-forced forward), the same
recorded while it writes its answers in batches (:func:`batch_answers`), and its output
path as rows (:class:`TargetOutput`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from specdec import ModelLoadError
from specdec.capture import model_taps
from specdec.checkpoints import text_model
from specdec.heads import model_vocab_size, output_layer


class Recorded:
    """What the target computed over one sequence.

    Attributes:
        hidden: ``[n, H]`` hidden states after the final norm.
        top_ids: ``[n, k]`` the ``k`` most likely next tokens at each position.
        top1: ``[n]`` the argmax at each position.
        kv: ``{cache index: (keys, values)}``, each ``[n, kv_heads, head_dim]``
            (position first), for the caches asked for (``kv_layers``); empty otherwise.
        layers: ``{layer index: [n, H]}``: the outputs of the decoder layers asked for
            (``layers``, in the model's dtype; since 0.1.1); empty otherwise.
    """

    __slots__ = ("hidden", "top_ids", "top1", "kv", "layers")

    def __init__(
        self,
        hidden: mx.array,
        top_ids: mx.array,
        top1: mx.array,
        kv: dict | None = None,
        layers: dict | None = None,
    ) -> None:
        self.hidden, self.top_ids, self.top1 = hidden, top_ids, top1
        self.kv = kv or {}
        self.layers = layers or {}

    @classmethod
    def of(
        cls,
        hidden: mx.array,
        logits: mx.array,
        k: int,
        kv: dict | None = None,
        layers: dict | None = None,
    ) -> Recorded:
        """From hidden states and logits ``[n, V]``."""
        logits = logits.astype(mx.float32)
        k = max(1, min(k, logits.shape[-1]))
        # a copy: a slice would keep the whole [n, V] partition alive
        ids = mx.contiguous(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        return cls(hidden.astype(mx.float32), ids, mx.argmax(logits, axis=-1), kv, layers)


def _forward(
    model: Any, tokens: Sequence[int], kv_layers: Sequence[int] = (), layers: Sequence[int] = ()
) -> tuple[mx.array, mx.array, dict, dict]:
    """One teacher-forced forward: hidden ``[L, H]``, logits ``[L, V]`` float32, the
    K/V ``{i: ([L, kv_heads, d], ...)}`` of the caches ``kv_layers`` and the outputs
    ``{i: [L, H]}`` of the decoder layers ``layers``."""
    from mlx_lm.models.cache import make_prompt_cache

    taps = model_taps(model)
    caches = make_prompt_cache(model) if kv_layers else None
    with taps.recording(layers) as rec:
        logits = model(mx.array(list(tokens))[None], cache=caches)
    h = rec["hidden"][0]
    outs = {i: rec["layers"][i][0] for i in layers}
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
    mx.eval(h, logits, kv, outs)
    return h, logits[0].astype(mx.float32), kv, outs


def record(
    model: Any,
    tokens: Sequence[int],
    *,
    top_k: int = 1,
    kv_layers: Sequence[int] = (),
    layers: Sequence[int] = (),
) -> Recorded:
    """What the target computes over ``tokens``, in one teacher-forced forward.

    Args:
        top_k: most likely next tokens kept per position.
        kv_layers: indices (in the model's cache list) of the caches whose keys and
            values to keep, for heads that attend to the target's K/V.
        layers: indices of the decoder layers whose outputs to keep (0-based), for
            heads conditioned on them (a DFlash drafter).
    """
    h, logits, kv, outs = _forward(model, tokens, kv_layers, layers)
    return Recorded.of(h, logits, top_k, kv, outs)


def target_hidden(model: Any, tokens: Sequence[int]) -> mx.array:
    """The target's hidden states ``[L, H]`` (after its final norm) for ``tokens``, one forward."""
    return _forward(model, tokens)[0]


class TargetOutput:
    """The target's output path as ``logits = h @ W.T + b`` (``W``: ``[V, H]``), read
    through :func:`specdec.heads.output_layer`: the layer's rows, dequantized, with a logit
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
    layers: Sequence[int] = (),
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
        layers: with ``record``, also keep the outputs of these decoder layers
            (``Recorded.layers``; since 0.1.1).

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
        # per forward: h, ids, top1, then the outputs of `layers`
        steps: list[tuple[mx.array, ...]] = []
        for _ in range(max_tokens):
            if taps is not None:
                with taps.recording(layers) as rec:
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
                        *(rec["layers"][i] for i in layers),
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
            h, ids, top1, *outs_of = (
                mx.concatenate([s[j] for s in steps], axis=1) for j in range(3 + len(layers))
            )
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
                states.append(
                    Recorded(
                        h[r, pad:end],
                        ids[r, pad:end],
                        top1[r, pad:end],
                        kv,
                        {i: o[r, pad:end] for i, o in zip(layers, outs_of)},
                    )
                )
            mx.eval([(s.hidden, s.top_ids, s.top1, s.kv, s.layers) for s in states[-len(group) :]])
        if on_batch is not None:
            on_batch(len(group))
    return answers, (states if taps is not None else None)
