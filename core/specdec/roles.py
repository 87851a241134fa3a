"""The roles a component plays, as Protocols, plus the records passed between them.

A plugin implements one of :class:`Drafter`, :class:`Verifier`, :class:`Acceptor`,
:class:`CacheRollback` or :class:`Governor` (subclassing the ``Base*`` classes
gives no-op defaults for the optional methods) and registers a factory for it
through a hook in :mod:`specdec.hookspecs`.

Token positions are absolute: position ``p`` is the index of a token in the
whole sequence (prompt included). The first generated token has position
``len(prompt_tokens)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from .sampling import Sampler


ROLES = ("drafter", "verifier", "acceptor", "cache_rollback", "governor")


@attrs.frozen
class Draft:
    """A block proposed by a drafter.

    Attributes:
        tokens: the proposed token ids, in order, following the last committed token.
        probs: optional draft distributions ``q`` of shape ``[len(tokens), vocab]``
            (probabilities, already filtered by the request's sampler). ``None``
            means the draft is deterministic (a point mass on each token).
    """

    tokens: tuple[int, ...] = attrs.field(converter=lambda t: tuple(int(x) for x in t))
    probs: Any = None


@attrs.frozen
class VerifyResult:
    """What a verifier returns for one target forward over ``n`` tokens.

    Attributes:
        logits: raw target logits, shape ``[n, vocab]``, float32.
        hidden: optional last hidden states, shape ``[n, hidden]`` (when a drafter needs them).
        extras: anything else a verifier captured (e.g. shared K/V), by name.
    """

    logits: Any
    hidden: Any = None
    extras: dict = attrs.field(factory=dict)


@attrs.frozen
class Acceptance:
    """Outcome of acceptance: ``n_accepted`` draft tokens kept, then ``token`` (correction or bonus)."""

    n_accepted: int
    token: int


@attrs.frozen
class RoundResult:
    """What a drafter and a governor are told after a round.

    Attributes:
        drafter: name of the drafter whose block was verified (``None`` on a plain step).
        block: the verified block.
        n_accepted: how many of ``block`` were accepted.
        token: the correction/bonus token emitted after the accepted prefix.
        committed: the tokens committed this round (``block[:n_accepted] + (token,)``,
            capped so ``max_tokens`` is never passed; a stop token inside it ends the stream there).
        verify: the verifier's result for this round.
        start_position: absolute position of ``block[0]`` (and of the first committed token).
    """

    drafter: str | None
    block: tuple[int, ...]
    n_accepted: int
    token: int
    committed: tuple[int, ...]
    verify: VerifyResult | None = None
    start_position: int = 0


@attrs.define
class RequestContext:
    """Everything a component may need about the current request, given at ``begin``.

    Attributes:
        model: the target mlx-lm model.
        tokenizer: the tokenizer (may be ``None`` for token-id prompts in tests).
        prompt_tokens: the prompt as token ids.
        max_tokens: the exact number of tokens to generate at most.
        sampler: the request's :class:`specdec.sampling.Sampler`.
        caches: the target's per-layer cache list.
        options: the policy options for this component.
        row: index of this request's row in a batch (always 0 for now).
        host: the plugin host the pipeline resolved its components from.
    """

    model: Any
    tokenizer: Any
    prompt_tokens: list[int]
    max_tokens: int
    sampler: Sampler
    caches: list
    options: dict = attrs.field(factory=dict)
    row: int = 0
    host: Any = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes a block of tokens after the last committed token."""

    name: str

    def begin(self, ctx: RequestContext) -> None:
        """Start a request. Called once, after the prompt has been prefilled."""

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Propose at most ``max_len`` tokens following ``history`` (prompt + committed output)."""

    def observe(self, result: RoundResult) -> None:
        """Learn what the round accepted (also called on rounds another drafter won)."""

    def end(self) -> None:
        """Finish a request (also after an error); drop per-request state."""


@runtime_checkable
class Verifier(Protocol):
    """Runs the target once over ``[last_token, *block]``."""

    name: str

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """Feed ``tokens`` (1-D int array) through ``model`` with ``caches``; return logits per position."""


@runtime_checkable
class Acceptor(Protocol):
    """Turns a block and the target's logits into an accepted prefix plus one token."""

    name: str

    def accept(
        self,
        block: Sequence[int],
        draft_probs: mx.array | None,
        logits: mx.array,
        sampler: Sampler,
        positions: Sequence[int],
    ) -> Acceptance:
        """Decide. ``logits`` is ``[len(block) + 1, vocab]`` after logits processors;
        ``positions[i]`` is the absolute position of the token drawn from ``logits[i]``."""


@runtime_checkable
class LayerTransaction(Protocol):
    """One layer cache's speculative transaction, opened by :meth:`CacheRollback.begin`."""

    def commit(self, n_fed: int, n_keep: int) -> None:
        """``n_fed`` tokens were fed since ``begin``; keep only the first ``n_keep`` of them."""

    def abort(self) -> None:
        """Restore the cache exactly as it was at ``begin``."""


@runtime_checkable
class CacheRollback(Protocol):
    """Makes a cache equal to "only the accepted prefix was ever fed"."""

    name: str

    def supports(self, cache: Any) -> bool:
        """Whether this rollback can handle ``cache`` (one entry of the model's cache list)."""

    def begin(self, cache: Any) -> LayerTransaction:
        """Open a transaction before the verify forward."""


@runtime_checkable
class Governor(Protocol):
    """Decides per round whether and how much a drafter may draft."""

    name: str

    def budget(self, drafter: str, max_len: int) -> int:
        """How many tokens ``drafter`` may propose this round (0 = skip it); at most ``max_len``."""

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        """Learn the outcome of a round in which ``drafter`` proposed ``proposed`` tokens."""

    def stats(self) -> dict:
        """A JSON-able summary of the governor's state, copied into the request's stats."""

    def observe_round(self, result: RoundResult) -> None:
        """Optional: see every round's outcome (also plain steps, ``result.drafter is None``)."""


class BaseDrafter:
    """Convenience base class: no-op ``begin``/``observe``/``end``."""

    name = "base"
    #: Verifier capabilities this drafter needs (e.g. ``{"hidden"}``).
    needs: frozenset = frozenset()

    def begin(self, ctx: RequestContext) -> None:
        """Start a request."""

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:  # pragma: no cover
        """Propose a block; subclasses override."""
        raise NotImplementedError

    def observe(self, result: RoundResult) -> None:
        """Learn the outcome of a round."""

    def end(self) -> None:
        """Finish a request."""

    def stats(self) -> dict:
        """Extra per-drafter statistics."""
        return {}


class BaseGovernor:
    """Convenience base class: a governor that never limits anything."""

    name = "base"

    def begin(self, ctx: RequestContext) -> None:
        """Start a request."""

    def budget(self, drafter: str, max_len: int) -> int:
        """Allow the full ``max_len``."""
        return max_len

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        """Ignore outcomes."""

    def observe_round(self, result: RoundResult) -> None:
        """Ignore rounds."""

    def stats(self) -> dict:
        """No state."""
        return {}
