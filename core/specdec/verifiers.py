"""Built-in verifiers: run the target once over ``[last_token, *block]``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .roles import VerifyResult


class LogitsVerifier:
    """Plain logits: ``model(tokens[None], cache=caches)[0]`` as float32."""

    name = "logits"

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward; logits ``[n, vocab]``."""
        logits = model(tokens[None], cache=caches)[0]
        return VerifyResult(logits=logits.astype(mx.float32))


class HiddenStateVerifier:
    """Logits plus the last hidden states, for drafters that read them (MTP heads).

    Works with mlx-lm models shaped like ``Model(model=<backbone>, lm_head?)``
    whose backbone returns the final normed hidden states.
    """

    name = "hidden"

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward; logits ``[n, vocab]`` and hidden states ``[n, hidden]``."""
        backbone = getattr(model, "model", None)
        if backbone is None:
            raise TypeError(
                f"verifier 'hidden' needs an mlx-lm model with a .model backbone; got {type(model).__name__}"
            )
        h = backbone(tokens[None], cache=caches)
        if getattr(model, "lm_head", None) is not None and not getattr(
            model.args, "tie_word_embeddings", False
        ):
            logits = model.lm_head(h)
        else:
            logits = backbone.embed_tokens.as_linear(h)
        return VerifyResult(logits=logits[0].astype(mx.float32), hidden=h[0])
