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

from .capture import ModelTaps, model_taps
from .errors import PolicyError
from .roles import BaseVerifier, VerifyResult


class LogitsVerifier(BaseVerifier):
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


class HiddenStateVerifier(BaseVerifier):
    """Logits plus the final hidden states and chosen layers' outputs, for drafters that read them.

    Works with mlx-lm models shaped like ``Model(model=<backbone with .norm and .layers>)``.

    Args:
        layers: decoder layers whose outputs every result carries (besides those
            the policy's drafters ask for through ``hidden_layers``).
        project: ``"all"``: the logits of every fed position come from the forward
            (the model's own call); ``"rows"``: a greedy round without logits
            processors projects the hidden states through the model's output path one
            position at a time and stops at the first position whose argmax is not the
            drafted token (for a large vocabulary, the output layer of the positions
            after a rejection is never computed; ``stats.row_projection`` counts it).
            Other rounds use the forward's logits either way.
    """

    name = "hidden"
    provides = frozenset({"logits", "hidden", "layer_hidden", "kv"})
    supports_batch = True

    def __init__(self, layers: Sequence[int] = (), project: str = "all"):
        try:
            self.layers = tuple(int(i) for i in layers)
        except (TypeError, ValueError) as exc:
            raise PolicyError(
                f"verifier 'hidden': option layers must be a list of layer indices, got {layers!r}"
            ) from exc
        if project not in ("all", "rows"):
            raise PolicyError(
                f"verifier 'hidden': option project must be 'all' or 'rows', got {project!r}"
            )
        self.project = project
        self._taps: ModelTaps | None = None

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

    def _bound(self, model: Any) -> ModelTaps:
        """The taps on ``model`` (installed at first use)."""
        if self._taps is None or self._taps.model is not model:
            self.bind(model)
        assert self._taps is not None
        return self._taps

    def verify_batch(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward over the rows of a batch (``tokens`` ``[B, n]``, rows
        right-padded, mlx-lm batch caches): logits ``[B, n, vocab]``, hidden states
        ``[B, n, hidden]``, layers ``[B, n, hidden]``. Always ``project="all"``."""
        taps = self._bound(model)
        with taps.recording(self.layers) as rec:
            logits = model(tokens, cache=caches)
        return VerifyResult(
            logits=logits.astype(mx.float32), hidden=rec["hidden"], layers=dict(rec["layers"])
        )

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """One target forward; logits ``[n, vocab]``, hidden states ``[n, hidden]``, layers."""
        taps = self._bound(model)
        with taps.recording(self.layers) as rec:
            logits = model(tokens[None], cache=caches)
        h = rec["hidden"]
        extras = {}
        if self.project == "rows":

            def project_row(i: int) -> mx.array:
                """The logits ``[vocab]`` of position ``i`` alone, through the model's own
                output path (the forward's ``logits`` stay unevaluated)."""
                return taps.head(h[:, i : i + 1])[0, 0].astype(mx.float32)

            extras["project_row"] = project_row
        return VerifyResult(
            logits=logits[0].astype(mx.float32),
            hidden=h[0],
            layers={i: x[0] for i, x in rec["layers"].items()},
            extras=extras,
        )
