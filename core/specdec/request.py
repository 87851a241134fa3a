"""A request's arguments as one frozen, validated record.

:class:`Request` is built by :meth:`specdec.Pipeline.stream`, :meth:`specdec.Batch.add`,
:meth:`specdec.Pipeline.check_request` and the server, so every argument is declared,
defaulted and checked in one place: a bad argument fails when the record is built,
before any model work, with a :class:`~specdec.errors.RequestError` naming it and what
is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from mlx_lm.sample_utils import make_logits_processors

from .errors import RequestError
from .grammar import Grammar
from .sampling import Sampler, validate_request

__all__ = ["Request"]


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
    return tuple(stop)


def _stop_tokens(tokens: Any) -> tuple[int, ...]:
    if tokens is None:
        return ()
    try:
        return tuple(int(t) for t in tokens)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"stop_tokens must be a list of token ids, got {tokens!r}") from exc


def _prefill_step(step: Any) -> int:
    if step is None or isinstance(step, bool) or not (isinstance(step, int) and step >= 1):
        raise RequestError(f"prefill_step_size must be an integer >= 1, got {step!r}")
    return step


@attrs.frozen(kw_only=True)
class Request:
    """The arguments of one request (everything but the prompt).

    Attributes:
        max_tokens: exact maximum of emitted tokens (>= 1).
        temperature, top_p, top_k, min_p, min_tokens_to_keep: sampling, as in mlx-lm.
        seed: seed of the position-keyed sampler (random if ``None``).
        stop: stop strings; the stream ends when the text contains one (the text is cut
            before it).
        stop_tokens: extra stop token ids besides the tokenizer's EOS set.
        logits_processors: mlx-lm style ``processor(tokens, logits) -> logits`` callables,
            applied at every verified position with that position's token history.
        repetition_penalty, repetition_context_size, presence_penalty, frequency_penalty,
            logit_bias: as mlx-lm's ``make_logits_processors``.
        prefill_step_size: prompt tokens per prefill forward.
        logprobs: ``None`` (off), or report each emitted token's log-probability under
            the target (its verify forward's logits after the logits processors, before
            temperature and the sampling filters: mlx-lm's ``logprobs``) with this many
            most likely alternatives (0: the token's own only) on
            :attr:`StreamResponse.logprob` / ``top_logprobs``.
        grammar: ``None``, or constrain the output to ``{"json_schema": schema}`` (a dict
            or its JSON text), ``{"regex": pattern}`` or ``{"lark": grammar}``
            (:class:`specdec.grammar.Grammar`, llguidance's syntax): every emitted token
            is one the grammar allows, under speculation too (docs/constrained.md).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    logits_processors: tuple[Callable[[Any, Any], Any], ...] = ()
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] | None = None
    prefill_step_size: int = 512
    logprobs: int | None = None
    grammar: Grammar | None = attrs.field(default=None, converter=Grammar.of)

    def __attrs_post_init__(self) -> None:
        # Checked in the order users have always seen the errors; normalized after.
        validate_request(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            min_tokens_to_keep=self.min_tokens_to_keep,
        )
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        _prefill_step(self.prefill_step_size)
        lp = self.logprobs
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or lp < 0):
            raise RequestError(
                f"logprobs must be None (off) or an integer >= 0 (alternatives per token), "
                f"got {lp!r}"
            )
        object.__setattr__(self, "stop_tokens", _stop_tokens(self.stop_tokens))
        object.__setattr__(self, "logits_processors", tuple(self.logits_processors or ()))

    @classmethod
    def of(cls, args: Mapping[str, Any], *, ignore_unknown: bool = False) -> Request:
        """A request from keyword arguments (``stream``'s ``**kwargs``).

        Raises:
            TypeError: an argument no request has (unless ``ignore_unknown``), naming
                the accepted ones.
            RequestError: a bad value.
        """
        names = {a.name for a in attrs.fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown and not ignore_unknown:
            raise TypeError(
                f"unexpected request argument(s) {unknown}; accepted are {sorted(names)}"
            )
        return cls(**{k: v for k, v in args.items() if k in names})

    def sampler(self) -> Sampler:
        """The request's position-keyed sampler."""
        return Sampler(
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=int(self.top_k),
            min_p=float(self.min_p),
            min_tokens_to_keep=self.min_tokens_to_keep,
            seed=self.seed,
        )

    def processors(self) -> list:
        """The logits processors: the request's own, then mlx-lm's penalties and bias."""
        return list(self.logits_processors) + make_logits_processors(
            None if self.logit_bias is None else dict(self.logit_bias),
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            20,
            self.frequency_penalty,
            20,
        )

    def stop_ids(self, tokenizer: Any) -> frozenset[int]:
        """The tokenizer's EOS ids and the request's ``stop_tokens``."""
        eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
        if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
            eos = {tokenizer.eos_token_id}
        return frozenset(eos | set(self.stop_tokens))


def prompt_ids(prompt: str | Sequence[int], tokenizer: Any, vocab_size: int | None) -> list[int]:
    """A prompt as token ids: text through ``tokenizer`` (no chat template), or ids checked
    against the vocabulary.

    Raises:
        RequestError: no tokenizer for text, an empty prompt, or an id out of range.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError(
                "this pipeline has no tokenizer: pass the prompt as a list of token ids"
            )
        ids = [int(t) for t in tokenizer.encode(prompt)]
    else:
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError) as exc:
            raise RequestError(
                f"prompt must be a string or a sequence of token ids, got {prompt!r}"
            ) from exc
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    if vocab_size is not None:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}")
    return ids
