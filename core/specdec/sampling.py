"""Samplers with mlx-lm's semantics and position-keyed randomness.

With a seed, the token at absolute position ``p`` is drawn with a random key
derived from ``(seed, p, stream)`` only, never from one sequential RNG stream.
Plain decoding and speculative decoding therefore draw the token at ``p`` with
the same key, and a sampled run whose drafts are deterministic emits exactly
the tokens of the same seeded run without speculation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import RequestError

_MASK64 = (1 << 64) - 1

#: Key streams: one per independent random decision at a position.
STREAM_TOKEN = 0
STREAM_ACCEPT = 1
STREAM_RESIDUAL = 2
STREAM_DRAFT = 3


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_key(seed: int, position: int, stream: int = STREAM_TOKEN) -> mx.array:
    """The random key for ``(seed, position, stream)``; independent of any other draw."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    h = _splitmix64(h ^ (stream & _MASK64))
    return mx.random.key(h >> 1)


def validate_request(
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
) -> None:
    """Check generation arguments before any model work.

    Raises:
        RequestError: naming the bad argument and what is accepted.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or temperature < 0
        or temperature != temperature
    ):
        raise RequestError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise RequestError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not isinstance(min_p, (int, float)) or not (0.0 <= min_p <= 1.0):
        raise RequestError(f"min_p must be in [0, 1] (0 = off), got {min_p!r}")
    if (
        isinstance(min_tokens_to_keep, bool)
        or not isinstance(min_tokens_to_keep, int)
        or min_tokens_to_keep < 1
    ):
        raise RequestError(
            f"min_tokens_to_keep must be an integer >= 1, got {min_tokens_to_keep!r}"
        )


@attrs.frozen
class Sampler:
    """Temperature / top-p / top-k / min-p sampling with mlx-lm's semantics.

    ``temperature == 0`` is greedy (argmax). Otherwise the distribution is
    ``softmax(filter(log_softmax(logits)) / temperature)`` where ``filter``
    applies top-p, then min-p, then top-k exactly as ``mlx_lm.sample_utils.make_sampler``.

    Attributes:
        temperature, top_p, top_k, min_p, min_tokens_to_keep: as in mlx-lm.
        seed: the seed of the position keys (a random one is chosen if ``None``).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: int = attrs.field(
        default=None,
        converter=lambda s: int.from_bytes(os.urandom(7), "little") if s is None else int(s),
    )

    def __attrs_post_init__(self) -> None:
        validate_request(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            min_tokens_to_keep=self.min_tokens_to_keep,
        )

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0

    def key(self, position: int, stream: int = STREAM_TOKEN) -> mx.array:
        """The random key of ``position`` in ``stream``."""
        return position_key(self.seed, position, stream)

    def scaled_logits(self, logits: mx.array) -> mx.array:
        """Filtered, temperature-scaled logits ``[n, V]``; softmax of them is the sampling distribution."""
        logits = logits.astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.is_greedy:
            return logprobs
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0 and self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs * (1.0 / self.temperature)

    def probs(self, logits: mx.array) -> mx.array:
        """The sampling distribution ``[n, V]`` for raw (processed) logits ``[n, V]``."""
        if self.is_greedy:
            am = mx.argmax(logits, axis=-1)
            return (mx.arange(logits.shape[-1])[None, :] == am[:, None]).astype(mx.float32)
        return mx.softmax(self.scaled_logits(logits), axis=-1)

    def sample(
        self, logits: mx.array, positions: Sequence[int], stream: int = STREAM_TOKEN
    ) -> list[int]:
        """Draw one token per row of ``logits`` ``[n, V]``; row ``i`` uses the key of ``positions[i]``."""
        if self.is_greedy:
            return mx.argmax(logits, axis=-1).tolist()
        scaled = self.scaled_logits(logits)
        return self.sample_scaled(scaled, positions, stream)

    def sample_lazy(self, logits: mx.array, position: int, stream: int = STREAM_TOKEN) -> mx.array:
        """Like :meth:`sample` for one row ``[1, V]``, returned as an unevaluated ``(1,)`` array."""
        if self.is_greedy:
            return mx.argmax(logits, axis=-1)
        scaled = self.scaled_logits(logits)
        return mx.random.categorical(scaled[0], key=self.key(position, stream))[None]

    def sample_scaled(
        self, scaled: mx.array, positions: Sequence[int], stream: int = STREAM_TOKEN
    ) -> list[int]:
        """Draw from already scaled logits (``log`` of an unnormalised distribution)."""
        out = [
            mx.random.categorical(scaled[i], key=self.key(p, stream))
            for i, p in enumerate(positions)
        ]
        return mx.stack(out).tolist() if out else []

    def uniform(self, position: int, stream: int = STREAM_ACCEPT) -> float:
        """A uniform number in [0, 1) keyed by ``position``."""
        return mx.random.uniform(key=self.key(position, stream)).item()
