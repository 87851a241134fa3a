"""The roles a component plays, as Protocols, plus the records passed between them.

A plugin implements one of :class:`Drafter`, :class:`Verifier`, :class:`Acceptor`,
:class:`CacheRollback`, :class:`Governor` or :class:`DraftHead` (subclassing the
``Base*`` classes gives the defaults of the optional members) and registers a
factory for it through a hook in :mod:`specdec.hookspecs`.

Every member the core reads from a component is declared here: the Protocols hold
the required ones (what ``isinstance(obj, Drafter)`` checks), the ``Base*`` classes
the optional ones with their defaults, and :data:`OPTIONAL_MEMBERS` lists the
optional ones per role (derived from the ``Base*`` classes). The core reads an
optional member through :func:`optional`, never through a ``getattr`` of its own.

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

import inspect
import operator
from collections.abc import Callable, Sequence
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
#: - ``kv``: the target's caches are mlx-lm caches that :func:`specdec.kvview.kv_views` can read.
CAPABILITIES = ("logits", "hidden", "layer_hidden", "kv")


def _tokens(t: Any) -> Any:
    # A lazy mx.array of draft tokens stays lazy: the core feeds it to the verify
    # forward unevaluated and reads it back once, with the target's logits.
    if type(t).__name__ == "array" and type(t).__module__.startswith("mlx"):
        return t.reshape(-1)
    return tuple(_token_id(x) for x in t)


def _token_id(x: Any) -> int:
    # An int, or an integer scalar (numpy, a 0-d mx.array of an integer type); never a
    # float, string or bool, which int() would quietly turn into some other token.
    if type(x) is int:
        return x
    if isinstance(x, bool) or isinstance(x, (str, bytes, float)):
        raise TypeError(f"a draft token id must be an integer, got {x!r} ({type(x).__name__})")
    try:
        return operator.index(x)
    except TypeError:
        dtype = str(getattr(x, "dtype", ""))
        if "int" in dtype and getattr(x, "size", 0) == 1:
            return int(x)
        raise TypeError(
            f"a draft token id must be an integer, got {x!r} ({type(x).__name__})"
        ) from None


def _acceptance(value: Any) -> tuple[float, ...] | None:
    # floats, or None; what is out of range is refused when the draft is checked
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        raise TypeError(f"acceptance must be a sequence of floats, got {value!r}")
    return tuple(float(x) for x in value)


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
        acceptance: optional, the drafter's estimate for each position of the block of
            the chance that it is accepted given that every position before it was
            (``len(tokens)`` floats in ``[0, 1]``). In a :class:`specdec.Batch` a block
            that has it may be cut shorter when the forward it widens does not pay for
            the batch as a whole (:func:`specdec.costs.best_width`); a block without it
            is verified as proposed.
    """

    tokens: Any = attrs.field(converter=_tokens)
    probs: Any = None
    acceptance: tuple[float, ...] | None = attrs.field(default=None, converter=_acceptance)

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

    def row(self, i: int, n: int) -> VerifyResult:
        """Row ``i``'s first ``n`` positions of a batch result (``verify_batch``'s arrays
        are ``[B, width, ...]``) as one request's result; ``extras`` are not carried."""
        return VerifyResult(
            logits=self.logits[i, :n],
            hidden=None if self.hidden is None else self.hidden[i, :n],
            layers={k: v[i, :n] for k, v in self.layers.items()},
        )


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
            for shadow scoring against ``committed`` (see :class:`specdec.shadow.ShadowScore`).
        forced: how many of ``block``'s first tokens a constrained request's grammar
            forced (accepted whatever the drafter proposed after them; ``drafter`` is
            ``"grammar"`` when they are the whole block); 0 otherwise.
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
    forced: int = 0


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
        cost: the pipeline's :class:`specdec.costs.CostModel` (what a verify forward of each
            width costs at each context length, and what a round and a drafted round
            cost beyond it: ``round_overhead_s``, ``draft_overhead_s(drafter)``) when
            the drafter asked for it with ``uses_verify_cost``; ``None`` otherwise.
        cached: how many of the prompt's first tokens the caches held already when the
            request began (a ``prompt_cache``; 0 otherwise): they are not prefilled, so
            ``prefill`` sees chunks from this position on, and a session that needs the
            target's hidden states of earlier positions starts without them.
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
    cached: int = 0


@attrs.frozen
class BatchContext:
    """What a drafter's batch-level state may need, given to ``batch(ctx)``.

    Attributes:
        model: the target mlx-lm model.
        tokenizer: the tokenizer (may be ``None``).
        options: the policy options for this drafter.
        host: the plugin host the pipeline resolved its components from.
        verifier: the pipeline's verifier.
        max_rows: the most rows the batch holds at once.
    """

    model: Any
    tokenizer: Any
    options: dict = attrs.field(factory=dict)
    host: Any = None
    verifier: Any = None
    max_rows: int = 1


@attrs.frozen
class Ask:
    """One row's request for a block from a drafter with a :class:`DrafterBatch`: what
    ``session.propose(history, max_len)`` would have been asked alone.

    Attributes:
        row: the row's id in its batch (what ``Batch.add`` returned, ``ctx.row``).
        drafter: the drafter's name.
        session: the row's session of this drafter (the one given to ``join``).
        history: prompt + committed output (the target's caches hold all but the last).
        max_len: the most tokens to propose.
        index: the row's index in the target's batch caches this round (they change as
            rows leave).
    """

    row: int
    drafter: str
    session: Any
    history: Sequence[int]
    max_len: int
    index: int = 0


@runtime_checkable
class DrafterBatch(Protocol):
    """A drafter's state for all the rows of one :class:`specdec.Batch`, made by the
    drafter's optional ``batch(ctx)`` when the batch starts: its draft steps run once
    for every asking row (one forward per step), its own caches hold one row per
    request. Rows are named by their ids (``ctx.row`` of their sessions), stable while
    other rows join and leave.

    The batch calls, between rounds, ``join`` for a row that was prefilled alone (its
    session saw the prompt's chunks) and ``leave`` for rows that are gone; in a round,
    ``propose`` once with the asks of every row whose plan reached this drafter, then,
    after the target's commit, ``observe`` once with every row's result; ``end`` when
    the batch closes. The rows' sessions still get ``observe``/``end``/``stats`` as
    alone, but not ``propose``.
    """

    def join(self, row: int, session: Any) -> None:
        """Take over a row's state from its session (e.g. its draft cache, prefilled alone)."""

    def leave(self, rows: Sequence[int]) -> None:
        """Drop these rows (finished, failed or cancelled)."""

    def propose(self, asks: Sequence[Ask], caches: list) -> list[Draft | None]:
        """One draft per ask, in order (``None``: nothing to propose for that row).
        ``caches`` are the target's batch caches (row ``ask.index`` holds all of
        ``ask.history`` but the last token). Raising fails every asking row and must
        leave the state of the rows as it was."""

    def observe(self, results: dict[int, RoundResult]) -> None:
        """The round's outcome for every row that took part (row id -> result)."""

    def end(self) -> None:
        """The batch closed: drop everything."""


@runtime_checkable
class DrafterSession(Protocol):
    """One request's drafting state, made by :meth:`Drafter.session`.

    Optional members (defaults in :class:`BaseDrafterSession`; absent: not called):

    - ``prefill(chunk: PrefillChunk) -> None``, called for every prompt chunk the
      verifier feeds (in order), so a head can prime itself on the prompt.
    - ``shadow(history: Sequence[int], max_len: int) -> Draft | None``, called
      instead of ``propose`` on a round where the governor gave the drafter no budget:
      what it would have proposed, without counting it as a proposal. The tokens go
      to the governor in ``RoundResult.shadows`` for shadow scoring. Implement it only
      when proposing is cheap (a lookup), since it runs on rounds that draft nothing.
    - ``stats() -> dict``: extra per-request statistics, merged into
      ``stats.per_drafter[name]``.
    - ``drafts_after_forced: bool`` (default ``False``): on a constrained request whose
      grammar forces the next tokens, ``propose`` may be called with ``history`` ending
      in those forced tokens, which are not committed yet (they are the block's first
      tokens and cannot be rejected; ``RoundResult.forced`` counts them). Sessions that
      do not declare it are not asked on such rounds (the block is the forced tokens).
    """

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Propose at most ``max_len`` tokens following ``history`` (prompt + committed output)."""

    def observe(self, result: RoundResult) -> None:
        """Learn what the round committed (also called on rounds another drafter won)."""

    def end(self) -> None:
        """Finish the request (also after an error); drop per-request state."""


@runtime_checkable
class Drafter(Protocol):
    """Proposes blocks of tokens; pipeline-wide, with one :class:`DrafterSession` per request.

    Attributes:
        name: the component name.

    Optional members (defaults in :class:`BaseDrafter`): ``needs`` (verifier
    capabilities, a subset of :data:`CAPABILITIES`; declared at registration),
    ``supports_batch`` (declared at registration), ``hidden_layers`` (decoder layer
    indices whose outputs it needs, with ``layer_hidden``), ``head`` (the name of the
    draft head it uses, usually its ``head`` option; the pipeline builds it and hands
    it over as ``ctx.head``), ``head_model`` / ``head_tokenizer`` (a model of its own
    whose output layer the head reads, and that model's tokenizer), ``uses_verify_cost``,
    ``deterministic``, ``attach(model, tokenizer)`` (called once by ``assemble`` to
    check the target before any request), ``batch(ctx)`` (its :class:`DrafterBatch`
    for the rows of a batch, with ``supports_batch``).
    """

    name: str

    def session(self, ctx: RequestContext) -> DrafterSession:
        """Start a request: a fresh session holding all per-request state."""


@runtime_checkable
class Verifier(Protocol):
    """Runs the target once over ``[last_token, *block]`` (and over prompt chunks in prefill).

    Attributes:
        name: the component name.

    Optional members (defaults in :class:`BaseVerifier`): ``provides`` (capabilities
    from :data:`CAPABILITIES`; declared at registration), ``supports_batch`` (declared
    at registration), ``layers`` (decoder layers its results carry),
    ``bind(model, *, layers=())`` (called once by ``assemble`` with the decoder layers
    drafters asked for), ``verify_batch(model, tokens, caches)`` (the rows of a batch).
    """

    name: str

    def verify(self, model: Any, tokens: mx.array, caches: list) -> VerifyResult:
        """Feed ``tokens`` (1-D int array) through ``model`` with ``caches``; return logits per position."""


@runtime_checkable
class Acceptor(Protocol):
    """Turns a block and the target's logits into an accepted prefix plus one token.

    No optional members.
    """

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
    """One layer cache's speculative transaction, opened by :meth:`CacheRollback.begin`.

    No optional members.
    """

    def commit(self, n_fed: int, n_keep: int) -> None:
        """``n_fed`` tokens were fed since ``begin``; keep only the first ``n_keep`` of them."""

    def abort(self) -> None:
        """Restore the cache exactly as it was at ``begin``."""


@runtime_checkable
class CacheRollback(Protocol):
    """Makes a cache equal to "only the accepted prefix was ever fed".

    Optional members (defaults in :class:`BaseCacheRollback`): ``supports_batch``
    (whether it rolls back the rows of a batch by different amounts; read from the
    instance, so it may depend on options), ``bind(plan)`` (called once when a
    :class:`specdec.rollback.RollbackPlan` takes the rollback, before it is asked ``supports``).
    """

    name: str

    def supports(self, cache: Any) -> bool:
        """Whether this rollback can handle ``cache`` (one entry of the model's cache list)."""

    def begin(self, cache: Any) -> LayerTransaction:
        """Open a transaction before the verify forward."""


@runtime_checkable
class GovernorSession(Protocol):
    """One request's governing state, made by :meth:`Governor.session`.

    Optional member (default in :class:`BaseGovernorSession`): ``wants_shadows: bool``
    (absent: True): whether the pipeline asks the sessions this governor refused for
    shadow proposals (``RoundResult.shadows``). A governor that does not score them
    sets it False.
    """

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


@runtime_checkable
class Governor(Protocol):
    """Decides per round whether and how much a drafter may draft; one session per request.

    Optional member (default in :class:`BaseGovernor`): ``supports_batch`` (declared
    at registration).
    """

    name: str

    def session(self, ctx: RequestContext) -> GovernorSession:
        """Start a request: a fresh session holding all per-request state."""


@runtime_checkable
class DraftHead(Protocol):
    """Turns hidden states into draft logits, for drafters that name it (``head`` option).

    Built once per (model, options) by the plugin host and shared by every
    drafter that names it; its ``bind`` is called once with the target model.

    Attributes:
        name: the component name.

    Optional members (defaults in :class:`BaseDraftHead`): ``vocab_size`` (the size
    of the vocabulary its logits cover, must equal the target's; absent or ``None``:
    not checked), ``bind(model, tokenizer=None)`` (prepare for ``model``: read its
    output layer, build a coarse copy, ...; ``tokenizer``, which may be ``None``, is
    passed only when ``bind`` has that parameter), ``stats() -> dict`` (what the head
    did, JSON-able, copied into ``stats.draft_heads``).
    """

    name: str

    def logits(self, hidden: mx.array, context: Sequence[int] | None = None) -> mx.array:
        """Draft logits ``[n, vocab]`` (float32) for hidden states ``[n, hidden]``.

        ``context``: the request's tokens so far (drafters pass their ``history``). A
        head that scores only some candidates returns ``-inf`` elsewhere, so the
        sampler's probabilities are ``q`` over the candidates (zero elsewhere).
        """


class BaseDrafterSession:
    """Convenience base class for sessions: no-op ``prefill``/``observe``/``end``, empty
    ``stats``, no ``shadow``."""

    #: ``shadow(history, max_len) -> Draft | None``: what it would have proposed on a
    #: round the governor gave it no budget (``None``: not asked).
    shadow: Callable[[Sequence[int], int], Draft | None] | None = None
    #: ``propose`` may be given a history that ends in a grammar's forced tokens, not yet
    #: committed (see :class:`DrafterSession`).
    drafts_after_forced: bool = False

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
    #: A model of its own whose output layer its head reads (``None``: the target's).
    head_model: Any = None
    #: The tokenizer of ``head_model`` (``None``: the pipeline's).
    head_tokenizer: Any = None
    #: Whether its sessions can run as rows of a batch.
    supports_batch: bool = False
    #: Whether its sessions read ``ctx.cost`` (the pipeline then builds a
    #: :class:`specdec.costs.CostModel`, profiling the model once per device).
    uses_verify_cost: bool = False
    #: Whether its proposals (block and ``q``) depend only on the history and the
    #: target's outputs, never on anything local to a process (timings, randomness):
    #: on a model sharded across ranks, ``q`` is then not broadcast from rank 0 when
    #: every rank proposed the same block.
    deterministic: bool = False

    #: ``attach(model, tokenizer)``: check the target once, at ``assemble``, before any
    #: request (``None``: nothing to check).
    attach: Callable[[Any, Any], None] | None = None
    #: ``batch(ctx: BatchContext) -> DrafterBatch``: the drafter's state for all rows of a
    #: batch, so its draft steps run once for every row (``None``: each row's session
    #: proposes alone). Needs ``supports_batch``.
    batch: Callable[[BatchContext], DrafterBatch] | None = None

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
    #: Whether its sessions can govern rows of a batch.
    supports_batch: bool = False

    def session(self, ctx: RequestContext) -> GovernorSession:
        """A :class:`BaseGovernorSession`."""
        return BaseGovernorSession()


class BaseVerifier:
    """Convenience base class for verifiers: logits only, one request at a time."""

    name = "base"
    #: Capabilities from :data:`CAPABILITIES` it provides.
    provides: frozenset = frozenset({"logits"})
    #: Whether it verifies the rows of a batch (then it has ``verify_batch``).
    supports_batch: bool = False
    #: Decoder layers whose outputs its results carry.
    layers: tuple = ()
    #: ``bind(model, *, layers=())``: told once which decoder layers the drafters read
    #: (``None``: it captures none, and a policy whose drafters ask for some is refused).
    bind: Callable[..., None] | None = None
    #: ``verify_batch(model, tokens, caches)``: one forward over the rows of a batch,
    #: ``tokens`` ``[B, n]`` (rows right-padded), logits ``[B, n, vocab]`` (``None``:
    #: it cannot verify rows of a batch).
    verify_batch: Callable[[Any, Any, list], VerifyResult] | None = None

    def verify(
        self, model: Any, tokens: mx.array, caches: list
    ) -> VerifyResult:  # pragma: no cover
        """One target forward; subclasses override."""
        raise NotImplementedError(f"verifier {self.name!r} does not implement verify")


class BaseCacheRollback:
    """Convenience base class for cache rollbacks: one request at a time, no ``bind``."""

    name = "base"
    #: Whether it rolls back the rows of a batch by different amounts.
    supports_batch: bool = False
    #: ``bind(plan)``: called once when a :class:`specdec.rollback.RollbackPlan` takes it (``None``:
    #: not called).
    bind: Callable[[Any], None] | None = None

    def supports(self, cache: Any) -> bool:  # pragma: no cover
        """Whether it can handle ``cache``; subclasses override."""
        return False

    def begin(self, cache: Any) -> LayerTransaction:  # pragma: no cover
        """Open a transaction; subclasses override."""
        raise NotImplementedError(f"cache rollback {self.name!r} does not implement begin")


class BaseDraftHead:
    """Convenience base class for draft heads: no vocabulary check, nothing to bind, no stats."""

    name = "base"
    #: The size of the vocabulary its logits cover (``None``: not checked).
    vocab_size: int | None = None

    def bind(self, model: Any, tokenizer: Any = None) -> None:
        """Prepare for ``model``; subclasses override (``tokenizer`` may be dropped)."""

    def logits(
        self, hidden: mx.array, context: Sequence[int] | None = None
    ) -> mx.array:  # pragma: no cover
        """Draft logits; subclasses override."""
        raise NotImplementedError(f"draft head {self.name!r} does not implement logits")

    def stats(self) -> dict:
        """What the head did."""
        return {}


# -- the declared members, in one place --------------------------------------------------

#: The Protocol of each role whose members the core reads (the registered roles of
#: :data:`ROLES` plus the per-request sessions and per-layer transactions).
PROTOCOLS: dict[str, type] = {
    "drafter": Drafter,
    "drafter_session": DrafterSession,
    "drafter_batch": DrafterBatch,
    "verifier": Verifier,
    "acceptor": Acceptor,
    "cache_rollback": CacheRollback,
    "layer_transaction": LayerTransaction,
    "governor": Governor,
    "governor_session": GovernorSession,
    "draft_head": DraftHead,
}

#: The ``Base*`` class of each role: its optional members and their defaults.
BASES: dict[str, type | None] = {
    "drafter": BaseDrafter,
    "drafter_session": BaseDrafterSession,
    "drafter_batch": None,
    "verifier": BaseVerifier,
    "acceptor": None,
    "cache_rollback": BaseCacheRollback,
    "layer_transaction": None,
    "governor": BaseGovernor,
    "governor_session": BaseGovernorSession,
    "draft_head": BaseDraftHead,
}


def _protocol_members(proto: type) -> frozenset:
    names = set(getattr(proto, "__annotations__", {}))
    names.update(n for n, v in vars(proto).items() if not n.startswith("_") and callable(v))
    return frozenset(n for n in names if not n.startswith("_"))


def _optional_members(base: type | None, required: frozenset) -> dict[str, Any]:
    # A Base class's public members beyond the Protocol's are the optional ones; a
    # method's default is None (absent: the core does not call it), an attribute's is
    # its value on the Base class.
    if base is None:
        return {}
    out: dict[str, Any] = {}
    for n, v in vars(base).items():
        if n.startswith("_") or n in required:
            continue
        out[n] = None if inspect.isfunction(v) else v
    return out


#: The members each role must have (role -> names), from the Protocols.
REQUIRED_MEMBERS: dict[str, frozenset] = {
    role: _protocol_members(proto) for role, proto in PROTOCOLS.items()
}

#: The members the core reads that a component may leave out, with the value the core
#: uses when it does: ``{role: {member: default}}``, derived from the ``Base*`` classes
#: (a method's default is ``None``: the core does not call it).
OPTIONAL_MEMBERS: dict[str, dict[str, Any]] = {
    role: _optional_members(BASES[role], REQUIRED_MEMBERS[role]) for role in PROTOCOLS
}

#: What a plugin declares when it registers a component (``register(name, factory,
#: needs=..., ...)``), by role: read before any component is built.
REGISTRATION_METADATA: dict[str, tuple[str, ...]] = {
    "drafter": ("needs", "supports_batch"),
    "verifier": ("provides", "supports_batch"),
    "governor": ("supports_batch",),
}


def optional(obj: Any, role: str, name: str) -> Any:
    """Read the optional member ``name`` of ``obj`` (a component of ``role``): its value,
    or the declared default (:data:`OPTIONAL_MEMBERS`) when ``obj`` lacks it.

    ``obj`` may be ``None`` (no such component): the default comes back.

    Raises:
        LookupError: ``name`` is not an optional member declared for ``role`` (a
            programming error in the caller, not a plugin's).
    """
    try:
        default = OPTIONAL_MEMBERS[role][name]
    except KeyError:
        if role not in OPTIONAL_MEMBERS:
            raise LookupError(
                f"no role {role!r}: roles are {', '.join(OPTIONAL_MEMBERS)}"
            ) from None
        declared = ", ".join(sorted(OPTIONAL_MEMBERS[role])) or "(none)"
        raise LookupError(
            f"{name!r} is not an optional member of a {role}: declared ones are {declared}"
        ) from None
    return getattr(obj, name, default)


def missing(obj: Any, role: str) -> list[str]:
    """The required members of ``role`` (:data:`REQUIRED_MEMBERS`) that ``obj`` lacks: a
    method that is not callable, an attribute that is absent or empty; sorted."""
    proto = PROTOCOLS[role]
    out = []
    for name in sorted(REQUIRED_MEMBERS[role]):
        value = getattr(obj, name, None)
        is_method = callable(vars(proto).get(name))
        if (is_method and not callable(value)) or (not is_method and not value):
            out.append(name)
    return out
