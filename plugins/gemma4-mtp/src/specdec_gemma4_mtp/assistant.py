"""The Gemma 4 assistant (``model_type: gemma4_assistant``): its config and its module.

One draft step, for a token ``x`` (the last committed one, or the previous draft) and
the target's hidden state ``h`` that came before it (checked against Hugging Face
transformers' ``modeling_gemma4_assistant.py``, vLLM's ``gemma4_mtp.py`` and mlx-vlm's
``speculative/drafters/gemma4_assistant``; the plugin README says where they differ)::

    e = target.embed_tokens(x) * sqrt(H_target)       # the target's own embeddings
    z = pre_projection(concat[e, h])                   # 2 H_target -> H
    for each layer (type sliding / full, from text_config.layer_types):
        q = rope(q_norm(q_proj(input_layernorm(z))))   # at a fixed position per round
        a = attention(q, K_t, V_t)                     # the TARGET's K/V of that type,
                                                       # scale 1.0; no K/V of its own
        z = z + post_attention_layernorm(o_proj(a))
        z = z + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(z)))
        z = z * layer_scalar
    n = norm(z)
    logits = n @ embed_tokens.T                        # its own tied embeddings, or the
                                                       # centroid-masked embedder
    h' = post_projection(n)                            # H -> H_target: the next step's h

Module attribute names follow the checkpoint keys (``model.layers.0.self_attn.q_proj``,
``pre_projection``, ``masked_embedding.centroids``), so a checkpoint loads with
``load_weights`` as it is stored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import specdec

MODEL_TYPE = "gemma4_assistant"
LAYER_TYPES = ("sliding_attention", "full_attention")


class AssistantLoadError(specdec.ModelLoadError):
    """The assistant cannot be read, or does not fit the target (the message says why)."""


def _get(cfg: Mapping, key: str, default: Any = None) -> Any:
    v = cfg.get(key, default)
    return default if v is None else v


@attrs.frozen
class AssistantConfig:
    """What the assistant's ``config.json`` says (top level and ``text_config``).

    Attributes:
        backbone_hidden_size: the target's hidden size ``H_target``.
        hidden_size, intermediate_size, num_hidden_layers: the assistant's own sizes.
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"``: which of
            the target's K/V it reads.
        num_attention_heads: query heads.
        head_dim, global_head_dim: the query head size of sliding and full layers.
        sliding_window: the window of the sliding layers.
        vocab_size: the vocabulary (the target's).
        rms_norm_eps: the norms' epsilon.
        use_ordered_embeddings: logits through the centroid-masked embedder.
        num_centroids, centroid_intermediate_top_k: the masked embedder's clusters and
            how many are kept per step.
        final_logit_softcapping: a soft cap of the assistant's logits (``None`` in every
            official checkpoint).
        block_size: drafts per round plus one (mlx-vlm's ``block_size``; absent in
            Hugging Face configs: 4, three drafts).
        raw: the config as read.
    """

    backbone_hidden_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple
    num_attention_heads: int
    head_dim: int
    global_head_dim: int
    sliding_window: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    final_logit_softcapping: float | None = None
    block_size: int = 4
    raw: dict = attrs.field(factory=dict, eq=False, repr=False)

    @property
    def depth(self) -> int:
        """Drafts per round the assistant was configured for (``block_size - 1``)."""
        return max(1, self.block_size - 1)

    def layer_head_dim(self, i: int) -> int:
        """The query head size of layer ``i``."""
        return self.global_head_dim if self.layer_types[i] == "full_attention" else self.head_dim

    @classmethod
    def from_dict(cls, cfg: Mapping) -> AssistantConfig:
        """Read a ``gemma4_assistant`` config (as Hugging Face writes it).

        Raises:
            AssistantLoadError: not a ``gemma4_assistant`` config, or a field missing or
                out of range (the message names it).
        """
        if not isinstance(cfg, Mapping):
            raise AssistantLoadError(
                f"gemma4_mtp: the assistant config is not a JSON object: {cfg!r}"
            )
        mt = cfg.get("model_type")
        if mt != MODEL_TYPE:
            raise AssistantLoadError(
                f"gemma4_mtp: the assistant's config.json has model_type {mt!r}; expected "
                f"{MODEL_TYPE!r} (a Gemma 4 assistant checkpoint, e.g. "
                "google/gemma-4-E2B-it-assistant)"
            )
        text = cfg.get("text_config")
        if not isinstance(text, Mapping):
            raise AssistantLoadError("gemma4_mtp: the assistant's config.json has no text_config")
        need = (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        missing = [k for k in need if not isinstance(text.get(k), int) or text.get(k) < 1]
        if missing or not isinstance(cfg.get("backbone_hidden_size"), int):
            raise AssistantLoadError(
                "gemma4_mtp: the assistant's config.json lacks "
                f"{missing + ([] if isinstance(cfg.get('backbone_hidden_size'), int) else ['backbone_hidden_size'])} "
                "(positive integers)"
            )
        n = text["num_hidden_layers"]
        types = text.get("layer_types")
        if types is None:
            types = ["sliding_attention"] * (n - 1) + ["full_attention"]
        types = tuple(types)
        bad = [t for t in types if t not in LAYER_TYPES]
        if len(types) != n or bad:
            raise AssistantLoadError(
                f"gemma4_mtp: text_config.layer_types must list {n} of {list(LAYER_TYPES)}, "
                f"got {list(types)}"
            )
        for k in ("hidden_size_per_layer_input", "num_experts"):
            if _get(text, k, 0):
                raise AssistantLoadError(
                    f"gemma4_mtp: text_config.{k} = {text[k]!r}: an assistant has no per-layer "
                    "inputs or experts"
                )
        head_dim = int(_get(text, "head_dim", 256))
        return cls(
            backbone_hidden_size=int(cfg["backbone_hidden_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text["intermediate_size"]),
            num_hidden_layers=int(n),
            layer_types=types,
            num_attention_heads=int(text["num_attention_heads"]),
            head_dim=head_dim,
            global_head_dim=int(_get(text, "global_head_dim", head_dim)),
            sliding_window=int(_get(text, "sliding_window", 512)),
            vocab_size=int(text["vocab_size"]),
            rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
            use_ordered_embeddings=bool(_get(cfg, "use_ordered_embeddings", False)),
            num_centroids=int(_get(cfg, "num_centroids", 2048)),
            centroid_intermediate_top_k=int(_get(cfg, "centroid_intermediate_top_k", 32)),
            final_logit_softcapping=text.get("final_logit_softcapping"),
            block_size=int(_get(cfg, "block_size", 4)),
            raw=dict(cfg),
        )

    def to_dict(self) -> dict:
        """The config as Hugging Face writes it (``config.json``)."""
        text = {
            "model_type": "gemma4_text",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim,
            "sliding_window": self.sliding_window,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "num_kv_shared_layers": self.num_hidden_layers,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "use_double_wide_mlp": False,
            "enable_moe_block": False,
            "hidden_activation": "gelu_pytorch_tanh",
            "final_logit_softcapping": self.final_logit_softcapping,
            "tie_word_embeddings": True,
        }
        raw_text = dict(self.raw.get("text_config") or {})
        raw_text.update(text)
        out = {k: v for k, v in self.raw.items() if k != "text_config"}
        out.update(
            {
                "model_type": MODEL_TYPE,
                "architectures": ["Gemma4AssistantForCausalLM"],
                "backbone_hidden_size": self.backbone_hidden_size,
                "use_ordered_embeddings": self.use_ordered_embeddings,
                "num_centroids": self.num_centroids,
                "centroid_intermediate_top_k": self.centroid_intermediate_top_k,
                "tie_word_embeddings": True,
                "block_size": self.block_size,
                "text_config": raw_text,
            }
        )
        return out


class _Attention(nn.Module):
    """Query side only: ``q_proj``, ``q_norm``, ``o_proj``; keys and values are the target's."""

    def __init__(self, cfg: AssistantConfig, i: int):
        super().__init__()
        hd = cfg.layer_head_dim(i)
        self.n_heads = cfg.num_attention_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * hd, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.rms_norm_eps)
        self.o_proj = nn.Linear(self.n_heads * hd, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array, kv: Any, rope: Any, position: Any, scale: float, mask: Any):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        q = rope(q.transpose(0, 2, 1, 3), offset=position)
        keys, values = kv
        o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: AssistantConfig, i: int):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[i]
        self.self_attn = _Attention(cfg, i)
        self.mlp = _MLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(cfg.hidden_size, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self.freeze(keys=["layer_scalar"], recurse=False)  # a buffer (as in transformers)

    def __call__(self, x, kv, rope, position, scale, mask):
        a = self.self_attn(self.input_layernorm(x), kv, rope, position, scale, mask)
        x = x + self.post_attention_layernorm(a)
        m = self.mlp(self.pre_feedforward_layernorm(x))
        x = x + self.post_feedforward_layernorm(m)
        return x * self.layer_scalar


class _Inner(nn.Module):
    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [_Layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class MaskedEmbedder(nn.Module):
    """The centroid-masked output layer of the small assistants (E2B, E4B).

    ``centroids`` scores ``num_centroids`` clusters of ``vocab / num_centroids`` tokens
    each (``token_ordering`` lists the clusters' token ids, cluster after cluster); the
    tokens of the ``top_k`` best clusters are scored with their rows of the tied
    embeddings, every other token gets ``-inf`` (so ``softmax`` is ``q`` over the
    candidates, zero elsewhere).
    """

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        if cfg.vocab_size % cfg.num_centroids:
            raise AssistantLoadError(
                f"gemma4_mtp: vocab_size {cfg.vocab_size} is not a multiple of num_centroids "
                f"{cfg.num_centroids}"
            )
        if not 1 <= cfg.centroid_intermediate_top_k <= cfg.num_centroids:
            raise AssistantLoadError(
                "gemma4_mtp: centroid_intermediate_top_k must be in 1..num_centroids, got "
                f"{cfg.centroid_intermediate_top_k}"
            )
        self.num_centroids = cfg.num_centroids
        self.top_k = cfg.centroid_intermediate_top_k
        self.per_cluster = cfg.vocab_size // cfg.num_centroids
        self.vocab_size = cfg.vocab_size
        self.centroids = nn.Linear(cfg.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering = mx.arange(cfg.vocab_size, dtype=mx.int32)
        self.freeze(keys=["token_ordering"], recurse=False)  # token ids: never trained

    def candidates(self, n: mx.array) -> mx.array:
        """The candidate token ids ``[rows, top_k * per_cluster]`` for normed states ``[rows, H]``."""
        scores = self.centroids(n)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
        table = self.token_ordering.reshape(self.num_centroids, self.per_cluster)
        return table[top].reshape(n.shape[0], -1)

    def __call__(self, n: mx.array, embed: nn.Embedding, softcap: float | None = None) -> mx.array:
        ids = self.candidates(n)  # [rows, c]
        if n.shape[0] > 4:
            # Many rows at once (evaluating a training run): the whole head and a mask
            # cost less than gathering top_k * per_cluster embedding rows per row.
            full = embed.as_linear(n).astype(mx.float32)
            if softcap:
                full = mx.tanh(full / softcap) * softcap
            keep = mx.put_along_axis(
                mx.zeros(full.shape, dtype=mx.bool_), ids, mx.array(True), axis=-1
            )
            return mx.where(keep, full, -mx.inf)
        rows = embed(ids)  # [rows, c, H] (a quantized embedding dequantizes its rows)
        sel = (rows @ n[:, :, None])[..., 0].astype(mx.float32)
        if softcap:
            sel = mx.tanh(sel / softcap) * softcap
        out = mx.full((n.shape[0], self.vocab_size), -mx.inf, dtype=mx.float32)
        return mx.put_along_axis(out, ids, sel, axis=-1)


class Gemma4Assistant(nn.Module):
    """The assistant's weights and its draft step (see the module docstring)."""

    def __init__(self, cfg: AssistantConfig):
        super().__init__()
        self.config = cfg
        self.model = _Inner(cfg)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, cfg.hidden_size, bias=False)
        self.post_projection = nn.Linear(cfg.hidden_size, cfg.backbone_hidden_size, bias=False)
        if cfg.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(cfg)

    def hidden(
        self,
        emb: mx.array,
        h: mx.array,
        kv: Mapping[str, tuple],
        ropes: Mapping[str, Any],
        position: Any,
        scales: Mapping[str, float],
        masks: Mapping[str, Any] | None = None,
    ) -> tuple[mx.array, mx.array]:
        """One step over ``L`` positions at once: normed states and next-step ``h``.

        Args:
            emb: ``[B, L, H_target]`` the target's scaled embeddings of the input tokens.
            h: ``[B, L, H_target]`` the target hidden state before each input token.
            kv: per layer type, the target's ``(keys, values)`` ``[B, kv_heads, S, d]``.
            ropes: per layer type, the RoPE that rotated those keys.
            position: the queries' RoPE offset (an int, or per position via ``masks``
                and a rope that takes an array).
            scales: per layer type, the attention scale.
            masks: per layer type, an additive or boolean mask ``[L, S]`` (``None``:
                every key).

        Returns:
            ``(n, h_next)``: ``[B, L, H]`` after the final norm (the logits' input) and
            ``[B, L, H_target]`` (the next step's ``h``).
        """
        x = self.pre_projection(mx.concatenate([emb, h], axis=-1))
        masks = masks or {}
        for layer in self.model.layers:
            t = layer.layer_type
            x = layer(x, kv[t], ropes[t], position, scales[t], masks.get(t))
        n = self.model.norm(x)
        return n, self.post_projection(n)

    def logits(self, n: mx.array, *, masked: bool = True) -> mx.array:
        """Logits ``[rows, vocab]`` float32 for normed states ``[rows, H]``.

        Args:
            masked: use the centroid-masked embedder when the assistant has one (``-inf``
                outside its candidates, soft-capping applied to the candidates only);
                ``False``: the whole tied head.
        """
        cap = self.config.final_logit_softcapping
        if masked and getattr(self, "masked_embedding", None) is not None:
            return self.masked_embedding(n, self.model.embed_tokens, cap)
        out = self.model.embed_tokens.as_linear(n).astype(mx.float32)
        if cap:
            out = mx.tanh(out / cap) * cap
        return out

    def n_params(self) -> int:
        """Parameters, embeddings included."""
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(self.parameters()))


def embed_scale(hidden: int) -> float:
    """``sqrt(H_target)``: the factor on the target's embeddings of the input token."""
    return math.sqrt(hidden)


def check_layer_types(cfg: AssistantConfig, available: Sequence[str]) -> None:
    """Raise when the assistant reads a layer type the target does not have.

    Raises:
        AssistantLoadError: naming the type and the target's types.
    """
    missing = sorted(set(cfg.layer_types) - set(available))
    if missing:
        raise AssistantLoadError(
            f"gemma4_mtp: the assistant reads the target's {missing} K/V, but the target's "
            f"layers are {sorted(set(available))}"
        )
