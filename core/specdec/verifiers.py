"""Built-in verifiers: run the target once over ``[last_token, *block]`` (or a prompt chunk).

Both go through the model's own forward, so their logits are exactly
``model(tokens[None], cache=caches)[0]``; ``hidden`` reads hidden states from
taps on the model's modules (:mod:`specdec.capture`) instead of rebuilding the
output step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from .capture import model_taps
from .errors import PolicyError
from .roles import VerifyResult


class LogitsVerifier:
    """Plain logits: ``model(tokens[None], cache=caches)[0]`` as float32."""

    name = "logits"
    provides = frozenset({"logits", "kv"})
    supports_batch = True

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward; logits ``[n, vocab]``."""
        logits = model(tokens[None], cache=caches)[0]
        return VerifyResult(logits=logits.astype(mx.float32))

    def verify_batch(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward over the rows of a batch: ``tokens`` ``[B, n]`` (rows
        right-padded), ``caches`` mlx-lm batch caches; logits ``[B, n, vocab]``."""
        logits = model(tokens, cache=caches)
        return VerifyResult(logits=logits.astype(mx.float32))


class HiddenStateVerifier:
    """Logits plus the final hidden states and chosen layers' outputs, for drafters that read them.

    Works with mlx-lm models shaped like ``Model(model=<backbone with .norm and .layers>)``.

    Args:
        layers: decoder layers whose outputs every result carries (besides those
            the policy's drafters ask for through ``hidden_layers``).
    """

    name = "hidden"
    provides = frozenset({"logits", "hidden", "layer_hidden", "kv"})

    def __init__(self, layers: Sequence[int] = ()):
        try:
            self.layers = tuple(int(i) for i in layers)
        except (TypeError, ValueError) as exc:
            raise PolicyError(
                f"verifier 'hidden': option layers must be a list of layer indices, got {layers!r}"
            ) from exc
        self._taps = None

    def bind(self, model: Any, *, layers: Sequence[int] = ()) -> None:
        """Install the taps on ``model`` and check the layer indices.

        Raises:
            PolicyError: the model cannot be tapped, or a layer index is out of range.
        """
        from .capture import TapError

        try:
            self._taps = model_taps(model)
            wanted = [*self.layers, *layers]
            for i in wanted:
                self._taps.layer_index(i)
        except (TapError, IndexError) as exc:
            raise PolicyError(f"verifier 'hidden': {exc}") from exc
        self.layers = tuple(dict.fromkeys(wanted))

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward; logits ``[n, vocab]``, hidden states ``[n, hidden]``, layers."""
        taps = self._taps if self._taps is not None and self._taps.model is model else None
        if taps is None:
            self.bind(model)
            taps = self._taps
        with taps.recording(self.layers) as rec:
            logits = model(tokens[None], cache=caches)
        return VerifyResult(
            logits=logits[0].astype(mx.float32),
            hidden=rec["hidden"][0],
            layers={i: h[0] for i, h in rec["layers"].items()},
        )
