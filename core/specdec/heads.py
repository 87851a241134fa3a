"""The built-in draft head ``exact``: the target's own output layer, through the model's path."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .capture import model_taps


def model_vocab_size(model: Any) -> int | None:
    """The vocabulary size of an mlx-lm model (``args.vocab_size``, else the embedding rows)."""
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    if v is None:
        emb = getattr(getattr(model, "model", None), "embed_tokens", None)
        w = getattr(emb, "weight", None)
        v = None if w is None else w.shape[0]
    return int(v) if v is not None else None


class ExactHead:
    """Draft logits from the target's own output path (head, logit scaling, softcapping).

    Exactly the logits the target would give for the same hidden states; the
    reference every other head is measured against.
    """

    name = "exact"

    def __init__(self) -> None:
        self.vocab_size: int | None = None
        self._taps = None
        self.calls = 0

    def bind(self, model: Any) -> None:
        """Tap ``model``'s backbone so hidden states can be run through its output path."""
        self._taps = model_taps(model)
        self.vocab_size = model_vocab_size(model)

    def logits(self, hidden: mx.array) -> mx.array:
        """``[n, H]`` (or ``[B, n, H]``) hidden states -> float32 logits ``[n, V]`` (``[B, n, V]``)."""
        if self._taps is None:
            raise RuntimeError("draft head 'exact' is not bound to a model (bind(model) first)")
        self.calls += 1
        if hidden.ndim == 2:
            return self._taps.head(hidden[None])[0].astype(mx.float32)
        return self._taps.head(hidden).astype(mx.float32)

    def stats(self) -> dict:
        """Calls made."""
        return {"kind": "exact", "calls": self.calls}
