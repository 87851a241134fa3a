"""The DFlash drafter's model: a block of mask tokens denoised in one forward, conditioned
on the target's hidden states.

What the published implementations agree on (z-lab's reference, vLLM, mlx-vlm, SGLang;
see ``docs/notes/dflash.md`` of the repository for where they differ):

- **Context features.** The outputs of the target's decoder layers ``target_layer_ids``
  (0-based), concatenated in that order (``[T, k * H]``), projected by ``fc``
  (``k * H -> H``, no bias) and normalised (``hidden_norm``, an RMSNorm).
- **Draft layers.** Qwen3 decoder layers: pre-norm attention with per-head ``q_norm`` /
  ``k_norm`` before RoPE, then a SiLU-gated MLP; a final ``norm``. Queries come from the
  block alone; keys and values are the layer's ``k_proj`` / ``v_proj`` of the projected
  context features (the same features for every layer) followed by the block's own. The
  block attends to all of it, without a causal mask. The context never goes through the
  MLP: each layer keeps only its keys and values (:meth:`DFlashModel.append_context`),
  one entry per committed position, so nothing is rolled back.
- **The block.** ``[last committed token, MASK, ..., MASK]`` embedded with the target's
  embeddings, at positions ``start .. start + B - 1`` (``start``: the last committed
  token's); the output at slot ``i >= 1`` (after ``norm``, through the target's output
  layer) predicts the token at slot ``i``: ``B - 1`` drafts per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

__all__ = ["DFlashConfig", "DFlashModel", "default_layer_ids"]


def default_layer_ids(target_layers: int, draft_layers: int) -> list[int]:
    """The target layers a drafter reads when its config names none (z-lab's and
    SGLang's rule): the middle layer for one draft layer, else ``draft_layers`` ids spread
    evenly from layer 1 to layer ``target_layers - 3``."""
    if draft_layers == 1:
        return [target_layers // 2]
    start, end = 1, target_layers - 3
    span = end - start
    return [int(round(start + i * span / (draft_layers - 1))) for i in range(draft_layers)]


@dataclass(frozen=True)
class DFlashConfig:
    """The shapes and the DFlash settings of a drafter (from its ``config.json``).

    Attributes:
        hidden_size: the draft's (and the target's) hidden size.
        num_hidden_layers: draft layers.
        num_attention_heads / num_key_value_heads / head_dim: the draft attention's.
        intermediate_size: the draft MLP's.
        rms_norm_eps: the norms' epsilon.
        rope_theta: RoPE's base (NeoX-style rotation).
        vocab_size: the vocabulary (the target's).
        attention_bias: whether q/k/v/o have biases.
        block_size: tokens per block (the last committed token and ``block_size - 1``
            drafts).
        mask_token_id: the token whose embedding fills the block after its first slot.
        target_layer_ids: the target layers whose outputs are the context features.
        num_target_layers: the target's layer count the drafter was trained for.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int


class _Attention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.scale = 1.0 / math.sqrt(c.head_dim)
        h, b = c.hidden_size, c.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=b)
        self.k_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=b)
        self.v_proj = nn.Linear(h, self.n_kv * self.head_dim, bias=b)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=b)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=c.rope_theta)

    def _heads(self, x: mx.array, n: int) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, n, self.head_dim).transpose(0, 2, 1, 3)

    def key_values(self, x: mx.array, offset: Any) -> tuple[mx.array, mx.array]:
        """Keys (normed, rotated at ``offset ..``) and values of ``x`` ``[N, T, H]``
        (``offset``: an int, or one per row, ``[N]``)."""
        k = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv)), offset=offset)
        return k, self._heads(self.v_proj(x), self.n_kv)

    def __call__(
        self,
        x: mx.array,
        offset: Any,
        ctx_k: mx.array | None,
        ctx_v: mx.array | None,
        mask: mx.array | None = None,
    ) -> mx.array:
        """The block ``x`` ``[N, B, H]`` at ``offset`` attending to the context's keys and
        values ``[N or 1, kv heads, S, d]`` and to itself (``mask``: which of those keys
        each block sees, ``[N, 1, B, S + B]``; ``None``: all)."""
        b, t, _ = x.shape
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=offset)
        k, v = self.key_values(x, offset)
        if ctx_k is not None and ctx_k.shape[2] > 0:
            if ctx_k.shape[0] != b:
                ctx_k = mx.broadcast_to(ctx_k, (b, *ctx_k.shape[1:]))
                ctx_v = mx.broadcast_to(ctx_v, (b, *ctx_v.shape[1:]))
            k = mx.concatenate([ctx_k, k], axis=2)
            v = mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = _MLP(c)

    def __call__(
        self, x: mx.array, offset: Any, ctx: tuple, mask: mx.array | None = None
    ) -> mx.array:
        ctx_k, ctx_v = ctx
        h = x + self.self_attn(self.input_layernorm(x), offset, ctx_k, ctx_v, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashModel(nn.Module):
    """The drafter's weights, named as in its Hugging Face checkpoint (``fc``,
    ``hidden_norm``, ``layers.{i}.…``, ``norm``)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.layers = [_Layer(c) for _ in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def make_cache(self) -> list[KVCache]:
        """One context cache per draft layer (keys and values of committed positions)."""
        return [KVCache() for _ in self.layers]

    def project(self, features: mx.array) -> mx.array:
        """The context features ``[..., k * H]`` (the chosen target layers' outputs,
        concatenated in ``target_layer_ids`` order) as the draft's ``[..., H]``."""
        return self.hidden_norm(self.fc(features))

    def context(self, features: mx.array, start: int) -> list[tuple[mx.array, mx.array]]:
        """Every layer's keys and values of positions ``start .. start + T - 1``, from
        their context features ``[1, T, k * H]``."""
        x = self.project(features)
        return [layer.self_attn.key_values(x, start) for layer in self.layers]

    def append_context(self, features: mx.array, start: int, caches: list[KVCache]) -> None:
        """Append the keys and values of positions ``start .. start + T - 1`` to every
        layer's cache, from their context features ``[1, T, k * H]`` (lazily)."""
        for (k, v), cache in zip(self.context(features, start), caches):
            cache.update_and_fetch(k, v)

    def forward(
        self, block: mx.array, start: Any, contexts: list, mask: mx.array | None = None
    ) -> mx.array:
        """The blocks' hidden states after the final norm, ``[N, B, H]``, from their
        embeddings ``[N, B, H]`` at positions ``start ..`` (an int or ``[N]``), each
        layer attending to its ``contexts[i]`` keys and values and the block (``mask``
        as :class:`_Attention`'s)."""
        x = block
        for layer, ctx in zip(self.layers, contexts):
            x = layer(x, start, ctx, mask)
        return self.norm(x)

    def __call__(self, block: mx.array, start: int, caches: list[KVCache]) -> mx.array:
        """The block's hidden states after the final norm, ``[1, B, H]``, from its
        embeddings ``[1, B, H]`` at positions ``start ..``; the caches are read, not
        written."""
        contexts = [
            (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
            if c.keys is not None
            else (None, None)
            for c in caches
        ]
        return self.forward(block, start, contexts)
