"""The roles a component plays, as Protocols, plus the records passed between them.

A plugin implements one of :class:`Drafter`, :class:`Verifier`, :class:`Acceptor`,
:class:`CacheRollback`, :class:`Governor` or :class:`DraftHead` (subclassing the
``Base*`` classes gives no-op defaults for the optional methods) and registers a
factory for it through a hook in :mod:`specdec.hookspecs`.

Components are pipeline-wide (one per :func:`specdec.assemble`); everything that
belongs to one request lives in a *session* the component makes for that request
(:meth:`Drafter.session`, :meth:`Governor.session`). Two requests on one pipeline,
interleaved as generators, never share a session.

Token positions are absolute: position ``p`` is the index of a token in the
whole sequence (prompt included). The first generated token has position
``len(prompt_tokens)``.

What the target's caches hold (the rule every drafter may rely on): when a
session's :meth:`DrafterSession.propose` is called with ``history``, the
target's caches hold exactly the entries of ``history[:-1]`` (every committed
token but the last; the last one is fed by the next verify forward, first in
the block). The same holds after prefill: the prompt's last token is fed by the
first round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import mlx.core as mx

    from .sampling import Sampler


ROLES = ("drafter", "verifier", "acceptor", "cache_rollback", "governor", "draft_head")

#: What a verifier can provide and a drafter can need (see :attr:`Verifier.provides`).
#:
#: - ``logits``: target logits per fed position, through the model's own output path.
#: - ``hidden``: the final hidden states (the input of the output head) per fed position.
#: - ``layer_hidden``: the outputs of chosen decoder layers (:attr:`Drafter.hidden_layers`).
#: - ``kv``: the target's caches are mlx-lm caches that :func:`specdec.kv_views` can read.
CAPABILITIES = ("logits", "hidden", "layer_hidden", "kv")


def _tokens(t: Any) -> Any:
    # A lazy mx.array of draft tokens stays lazy: the core feeds it to the verify
    # forward unevaluated and reads it back once, with the target's logits.
    if type(t).__name__ == "array" and type(t).__module__.startswith("mlx"):
        return t.reshape(-1)
    return tuple(int(x) for x in t)


@attrs.frozen
class Draft:
    """A block proposed by a drafter.

    Attributes:
        tokens: the proposed token ids, in order, following the last committed token:
            a sequence of ints, or a 1-D (possibly unevaluated) ``mx.array`` of token
            ids, which the core feeds to the verify forward without a host sync.
        probs: optional draft distributions ``q`` of shape ``[len(tokens), vocab]``
            (probabilities, already filtered by the request's sampler). ``None``
            means the draft is deterministic (a point mass on each token).
    """

    tokens: Any = attrs.field(converter=_tokens)
    probs: Any = None

    @property
    def size(self) -> int:
        """Number of proposed tokens (no host sync for a lazy array)."""
        t = self.tokens
        return len(t) if isinstance(t, tuple) else int(t.shape[0])


@attrs.frozen
class VerifyResult:
    """What a verifier returns for one target forward over ``n`` tokens.

    Attributes:
        logits: raw target logits, shape ``[n, vocab]``, float32, exactly what
            ``model(tokens[None], cache=caches)[0]`` returns.
        hidden: the final hidden states ``[n, hidden]`` (verifiers providing ``hidden``).
        layers: ``{layer_index: [n, hidden]}``, outputs of the decoder layers drafters
            asked for (verifiers providing ``layer_hidden``); indices as requested
            (negative ones count from the last layer).
        extras: anything else a verifier captured, by name.
    """

    logits: Any
    hidden: Any = None
    layers: dict = attrs.field(factory=dict)
    extras: dict = attrs.field(factory=dict)


@attrs.frozen
class PrefillChunk:
    """One chunk of the prompt as the verifier fed it during prefill.

    Attributes:
        tokens: the chunk's token ids.
        start_position: absolute position of ``tokens[0]``.
        result: the verifier's result for the chunk (hidden states for every
            position of the chunk when the verifier provides them).
    """

    tokens: tuple
    start_position: int
    result: VerifyResult


@attrs.frozen
class Acceptance:
    """Outcome of acceptance: ``n_accepted`` draft tokens kept, then ``token`` (correction or bonus)."""

    n_accepted: int
    token: int


@attrs.frozen
class RoundResult:
    """What drafter and governor sessions are told after a round.

    Attributes:
        drafter: name of the drafter whose block was verified (``None`` on a plain step).
        block: the verified block.
        n_accepted: how many of ``block`` were accepted.
        token: the correction/bonus token emitted after the accepted prefix.
        committed: the tokens committed this round (``block[:n_accepted] + (token,)``,
            capped so ``max_tokens`` is never passed; a stop token inside it ends the stream there).
        verify: the verifier's result for this round (its rows follow ``[last, *block]``).
        start_position: absolute position of ``block[0]`` (and of the first committed token).
        proposals: ``{drafter: tokens}`` of the sessions that proposed this round. The
            first acceptable proposal wins and later sessions are not asked, so today
            this holds the winner's block only (its full proposal, before any cut).
        shadows: ``{drafter: tokens}`` of the sessions that the governor gave no budget
            this round and that answered ``shadow()``: what they would have proposed,
            for shadow scoring against ``committed`` (see :class:`specdec.ShadowScore`).
    """

    drafter: str | None
    block: tuple[int, ...]
    n_accepted: int
    token: int
    committed: tuple[int, ...]
    verify: VerifyResult | None = None
    start_position: int = 0
    proposals: dict = attrs.field(factory=dict)
    shadows: dict = attrs.field(factory=dict)


@attrs.define
class RequestContext:
    """Everything a session may need about its request, given to ``session(ctx)``.

    Attributes:
        model: the target mlx-lm model.
        tokenizer: the tokenizer (may be ``None`` for token-id prompts in tests).
        prompt_tokens: the prompt as token ids.
        max_tokens: the exact number of tokens to generate at most.
        sampler: the request's :class:`specdec.sampling.Sampler`.
        caches: the target's per-layer cache list (empty at ``session()``: sessions
            are made before prefill; see the module docstring for what they hold later).
        options: the policy options for this component.
        row: the request's id in its :class:`specdec.Batch` (what ``Batch.add``
            returned; 0 for a request decoded alone).
        host: the plugin host the pipeline resolved its components from.
        verifier: the pipeline's verifier.
        head: the draft head the drafter named with its ``head`` option (``None`` otherwise).
        plan: the request's rollback plan over ``caches``.
        cost: the pipeline's :class:`specdec.CostModel` (what a verify forward of each
            width costs at each context length, and what a round and a drafted round
            cost beyond it: ``round_overhead_s``, ``draft_overhead_s(drafter)``) when
            the drafter asked for it with ``uses_verify_cost``; ``None`` otherwise.
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
    verifier: Any = None
    head: Any = None
    plan: Any = None
    cost: Any = None


@runtime_checkable
class DrafterSession(Protocol):
    """One request's drafting state, made by :meth:`Drafter.session`.

    Optional: ``prefill(chunk: PrefillChunk) -> None``, called for every prompt
    chunk the verifier feeds (in order), so a head can prime itself on the prompt.

    Optional: ``shadow(history: Sequence[int], max_len: int) -> Draft | None``, called
    instead of ``propose`` on a round where the governor gave the drafter no budget:
    what it would have proposed, without counting it as a proposal. The tokens go
    to the governor in ``RoundResult.shadows`` for shadow scoring. Implement it only
    when proposing is cheap (a lookup), since it runs on rounds that draft nothing.
    """

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Propose at most ``max_len`` tokens following ``history`` (prompt + committed output)."""

    def observe(self, result: RoundResult) -> None:
        """Learn what the round committed (also called on rounds another drafter won)."""

    def end(self) -> None:
        """Finish the request (also after an error); drop per-request state."""

    def stats(self) -> dict:
        """Extra per-request statistics, merged into ``stats.per_drafter[name]``."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes blocks of tokens; pipeline-wide, with one :class:`DrafterSession` per request.

    Attributes:
        name: the component name.
        needs: verifier capabilities the drafter needs (a subset of :data:`CAPABILITIES`).

    Optional attributes and methods: ``hidden_layers`` (decoder layer indices whose
    outputs it needs, with ``layer_hidden``), ``head`` (the name of the draft head
    it uses, usually its ``head`` option; the pipeline builds it and hands it over
    as ``ctx.head``), ``attach(model, tokenizer)`` (called once by ``assemble``
    to check the target before any request), ``supports_batch`` (False).
    """

    name: str
    needs: frozenset

    def session(self, ctx: RequestContext) -> DrafterSession:
        """Start a request: a fresh session holding all per-request state."""


@runtime_checkable
class Verifier(Protocol):
    """Runs the target once over ``[last_token, *block]`` (and over prompt chunks in prefill).

    Attributes:
        name: the component name.
        provides: capabilities from :data:`CAPABILITIES` this verifier provides.

    Optional: ``bind(model, *, layers=())``, called once by ``assemble`` with
    the decoder layers drafters asked for.
    """

    name: str
    provides: frozenset

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
class GovernorSession(Protocol):
    """One request's governing state, made by :meth:`Governor.session`."""

    def budget(self, drafter: str, max_len: int) -> int:
        """How many tokens ``drafter`` may propose this round (0 = skip it); at most ``max_len``."""

    def observe(self, drafter: str, proposed: int, accepted: int) -> None:
        """Learn the outcome of a round in which ``drafter`` proposed ``proposed`` tokens."""

    def observe_round(self, result: RoundResult) -> None:
        """See every round's outcome (also plain steps, ``result.drafter is None``)."""

    def stats(self) -> dict:
        """A JSON-able summary of the state, copied into the request's ``stats.governor``."""

    def end(self) -> None:
        """Finish the request."""

    # Optional attribute ``wants_shadows: bool`` (absent: True): whether the pipeline
    # asks the sessions this governor refused for shadow proposals
    # (``RoundResult.shadows``). A governor that does not score them sets it False.


@runtime_checkable
class Governor(Protocol):
    """Decides per round whether and how much a drafter may draft; one session per request."""

    name: str

    def session(self, ctx: RequestContext) -> GovernorSession:
        """Start a request: a fresh session holding all per-request state."""


@runtime_checkable
class DraftHead(Protocol):
    """Turns hidden states into draft logits, for drafters that name it (``head`` option).

    Built once per (model, options) by the plugin host and shared by every
    drafter that names it; :meth:`bind` is called once with the target model.

    Attributes:
        name: the component name.
        vocab_size: the size of the vocabulary its logits cover (must equal the target's).
    """

    name: str
    vocab_size: int

    def bind(self, model: Any, tokenizer: Any = None) -> None:
        """Prepare for ``model`` (read its output layer, build a coarse copy, ...).

        ``tokenizer`` (may be ``None``) is passed only when ``bind`` has that parameter.
        """

    def logits(self, hidden: mx.array, context: Sequence[int] | None = None) -> mx.array:
        """Draft logits ``[n, vocab]`` (float32) for hidden states ``[n, hidden]``.

        ``context``: the request's tokens so far (drafters pass their ``history``). A
        head that scores only some candidates returns ``-inf`` elsewhere, so the
        sampler's probabilities are ``q`` over the candidates (zero elsewhere).
        """

    def stats(self) -> dict:
        """What the head did (build time, extra memory, ...), JSON-able."""


class BaseDrafterSession:
    """Convenience base class for sessions: no-op ``prefill``/``observe``/``end``, empty ``stats``."""

    def prefill(self, chunk: PrefillChunk) -> None:
        """Ignore prompt chunks."""

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:  # pragma: no cover
        """Propose a block; subclasses override."""
        raise NotImplementedError

    def observe(self, result: RoundResult) -> None:
        """Learn the outcome of a round."""

    def end(self) -> None:
        """Finish a request."""

    def stats(self) -> dict:
        """Extra per-request statistics."""
        return {}


class BaseDrafter:
    """Convenience base class for drafters: no needs, no head; subclasses implement ``session``."""

    name = "base"
    #: Verifier capabilities this drafter needs (e.g. ``frozenset({"hidden"})``).
    needs: frozenset = frozenset()
    #: Decoder layers whose outputs it needs (with ``"layer_hidden"`` in ``needs``).
    hidden_layers: tuple = ()
    #: The name of the draft head it uses, or ``None``.
    head: str | None = None
    #: Whether its sessions can run as rows of a batch.
    supports_batch: bool = False
    #: Whether its sessions read ``ctx.cost`` (the pipeline then builds a
    #: :class:`specdec.CostModel`, profiling the model once per device).
    uses_verify_cost: bool = False
    #: Whether its proposals (block and ``q``) depend only on the history and the
    #: target's outputs, never on anything local to a process (timings, randomness):
    #: on a model sharded across ranks, ``q`` is then not broadcast from rank 0 when
    #: every rank proposed the same block.
    deterministic: bool = False

    def session(self, ctx: RequestContext) -> DrafterSession:  # pragma: no cover
        """Start a request; subclasses override."""
        raise NotImplementedError(f"drafter {self.name!r} does not implement session(ctx)")


class BaseGovernorSession:
    """A governor session that never limits anything."""

    #: Whether the pipeline asks the drafters this session refuses for shadow
    #: proposals (a subclass that does not score ``RoundResult.shadows`` may set False).
    wants_shadows: bool = True

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

    def end(self) -> None:
        """Nothing to drop."""


class BaseGovernor:
    """Convenience base class: a governor whose sessions never limit anything."""

    name = "base"
    supports_batch: bool = False

    def session(self, ctx: RequestContext) -> GovernorSession:
        """A :class:`BaseGovernorSession`."""
        return BaseGovernorSession()
