"""The ``dflash`` drafter: a whole block drafted by one forward of a DFlash model.

A round, for a history of ``n`` tokens (the last one, at ``n - 1``, not yet through the
target):

1. **Context.** The drafter's context cache holds one entry per position whose target
   features are known: the outputs of the target layers ``target_layer_ids``, from every
   prompt chunk (prefill) and from the verify forwards' rows of the tokens each round
   committed before its bonus token. The rows known since the last round are appended
   (:meth:`specdec_dflash.model.DFlashModel.append_context`), up to position ``n - 2``.
2. **The block.** ``[history[-1], MASK x (B - 1)]`` at positions ``n - 1 ..``, embedded
   with the target's embeddings, through the draft layers once; slot ``i`` (``i >= 1``)
   gives the logits of the token at ``n - 1 + i`` through the draft head (the target's
   output layer by default): up to ``B - 1`` drafts, drawn greedily, or from the
   request's sampler with the draft stream's keys (``q`` returned for rejection
   sampling).
3. **How many.** The block is priced like ``ngram_copy``'s: per-position acceptance
   estimates (:class:`specdec.costs.AcceptanceEstimate`) and the verify cost curve
   (:func:`specdec.costs.best_block`), the round's extra cost learnt by the pipeline;
   the estimates go with the draft (``Draft.acceptance``) so a batch may cut it.

Nothing is rolled back: the context cache only ever holds committed positions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import specdec
from specdec import (
    BaseDrafter,
    BaseDrafterSession,
    Draft,
    PrefillChunk,
    RequestContext,
    RoundResult,
)
from specdec.costs import AcceptanceEstimate, best_block
from specdec.options import Option, Options, non_empty

from .checkpoint import DFlashLoadError, load_dflash

NAME = "dflash"
#: Declined rounds in a row after which a block is drafted anyway (a probe).
PROBE_AFTER = 8

#: The options of ``dflash`` (see the README).
OPTIONS = Options(
    NAME,
    [
        Option("path", (str, os.PathLike), accepted="a DFlash checkpoint folder"),
        Option("max_draft", int, default=15, minimum=1),
        Option("head", str, default="exact", check=non_empty, accepted="a draft head name"),
        Option(
            "sizing",
            str,
            default="cost",
            choices=("cost", "fixed"),
            accepted="'cost' or 'fixed'",
        ),
        Option("overhead_quantum", float, default=0.25, minimum=0),
    ],
)


def embeddings(model: Any) -> Any:
    """The target's token embedding as its decoder layers see it: the embedding layer,
    times ``sqrt(hidden_size)`` for targets that scale their embeddings (``model_type``
    ``gemma*``, as mlx-lm's models do it: rounded to bfloat16 for ``gemma3*``; mlx-vlm's
    DFlash applies the target's embedding scale too)."""
    inner = getattr(model, "language_model", model)
    embed = getattr(getattr(inner, "model", None), "embed_tokens", None)
    if embed is None:
        raise DFlashLoadError(
            f"{NAME}: {type(model).__module__} has no model.embed_tokens: the drafter embeds "
            "its block with the target's embeddings"
        )
    kind = str(getattr(inner, "model_type", None) or getattr(model, "model_type", "") or "")
    if not kind.startswith("gemma"):
        return embed
    root = inner.args.hidden_size**0.5
    scale = mx.array(root, mx.bfloat16) if kind.startswith("gemma3") else mx.array(root)

    def scaled(ids: mx.array) -> mx.array:
        h = embed(ids)
        return h * scale.astype(h.dtype)

    return scaled


class DFlashDrafter(BaseDrafter):
    """Drafts a block with a DFlash model conditioned on the target's hidden states.

    Args:
        path: the drafter's checkpoint folder (Hugging Face layout: ``config.json`` with
            ``dflash_config``, ``*.safetensors``).
        max_draft: the most tokens drafted per round (at most ``block_size - 1``).
        head: the draft head turning the draft's hidden states into logits
            (``"exact"``: the target's output layer).
        sizing: ``"cost"``: each round's length from per-position acceptance estimates
            and the verify cost curve; ``"fixed"``: always ``max_draft`` (capped by the
            block).
        overhead_quantum: as ``ngram_copy``'s: the steps in which the learnt round
            overheads are read.

    Raises:
        specdec.PolicyError: an option has a bad value, or no ``path``.
    """

    name = NAME
    needs = frozenset({"layer_hidden"})
    supports_batch = True

    def __init__(self, **options: Any) -> None:
        o = OPTIONS.parse(options)
        if o.path is None:
            raise specdec.PolicyError(
                f"{NAME}: option path is required: the DFlash checkpoint folder to load"
            )
        self.path = Path(os.fspath(o.path)).expanduser()
        self.max_draft = o.max_draft
        self.head = o.head
        self.sizing = o.sizing
        self.overhead_quantum = o.overhead_quantum
        self.module: Any = None
        self.info: dict = {}
        self.hidden_layers: tuple[int, ...] = ()
        self._target: Any = None

    @property
    def uses_verify_cost(self) -> bool:
        """The cost sizing reads the pipeline's verify cost curve."""
        return self.sizing == "cost"

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Load the drafter for ``model`` (once per pipeline): its config is checked
        against the target before any weight is read.

        Raises:
            DFlashLoadError (a :class:`specdec.ModelLoadError`): see
                :func:`specdec_dflash.checkpoint.load_dflash`.
        """
        if self._target is model and self.module is not None:
            return
        self.module, self.info = load_dflash(self.path, model)
        self.hidden_layers = tuple(self.module.config.target_layer_ids)
        embeddings(model)
        self._target = model

    def session(self, ctx: RequestContext) -> DFlashSession:
        """A fresh context cache for the request."""
        if self.module is None or self._target is not ctx.model:
            self.attach(ctx.model, ctx.tokenizer)
        return DFlashSession(self, ctx)


class DFlashSession(BaseDrafterSession):
    """One request's context cache, pending features and acceptance estimates."""

    def __init__(self, drafter: DFlashDrafter, ctx: RequestContext) -> None:
        self.d = drafter
        self.module = drafter.module
        c = self.module.config
        self.ids = c.target_layer_ids
        self.block = c.block_size
        self.mask = c.mask_token_id
        self.caches = self.module.make_cache()
        self.embed = embeddings(ctx.model)
        if ctx.head is None:
            raise specdec.PolicyError(f"{NAME}: no draft head was handed over")
        self.head = ctx.head
        self.sampler = ctx.sampler
        self.cost = getattr(ctx, "cost", None)
        # context entries: positions ctx.cached .. fed - 1 (a request that starts from a
        # prompt cache has no features for the positions it held: the draft's context
        # starts at the first position prefilled)
        self.first = ctx.cached
        self.fed = ctx.cached
        self.pending: list[mx.array] = []  # feature rows for positions fed, fed + 1, ...
        self.pending_n = 0
        self.estimate = AcceptanceEstimate(max(1, self.block - 1))
        self.last: tuple[int, int] | None = None  # (position, drafted) of our proposal
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0
        self.gaps = 0
        self.broken = False
        self.sizes: dict[int, int] = {}
        self.declined = 0  # rounds in a row the sizing declined
        self.declined_total = 0

    # -- the context -------------------------------------------------------------------

    def _features(self, layers: dict) -> mx.array:
        missing = [i for i in self.ids if i not in layers]
        if missing:
            raise specdec.PolicyError(
                f"{NAME}: the verifier's results lack the outputs of target layers {missing} "
                "(its hidden_layers): use the 'hidden' verifier, with specdec-core >= 0.3.7 "
                "(which binds it after the drafter loaded its checkpoint)"
            )
        return mx.concatenate([layers[i] for i in self.ids], axis=-1)

    def _add(self, start: int, rows: mx.array) -> None:
        have = self.fed + self.pending_n
        if start > have:
            self.gaps += 1
            self.broken = True  # positions whose features never came: stop drafting
            return
        skip = have - start
        if skip < rows.shape[0]:
            self.pending.append(rows[skip:])
            self.pending_n += rows.shape[0] - skip

    def _catch_up(self, upto: int) -> bool:
        """Append the pending features of positions ``fed .. upto`` to the context."""
        n = upto + 1 - self.fed
        if n <= 0:
            return n == 0
        if self.pending_n < n:
            return False
        rows = self.pending[0] if len(self.pending) == 1 else mx.concatenate(self.pending)
        self.module.append_context(rows[:n][None], self.fed, self.caches)
        rest = rows[n:]
        self.pending = [rest] if rest.shape[0] else []
        self.pending_n -= n
        self.fed += n
        return True

    def prefill(self, chunk: PrefillChunk) -> None:
        """Keep the chunk's features (the chosen layers' outputs) for the context."""
        self._add(chunk.start_position, self._features(chunk.result.layers))

    # -- the Drafter protocol ------------------------------------------------------------

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Append the context up to ``len(history) - 2`` and draft the block (lazily)."""
        n = len(history)
        limit = min(max_len, self.d.max_draft, self.block - 1)
        if limit < 1 or self.broken or n < 2 or not self._catch_up(n - 2) or self.fed != n - 1:
            return None
        accept = self.estimate.probs(limit)
        k = limit if self.d.sizing == "fixed" or self.cost is None else self._size(accept, n)
        if k < 1:
            # The estimates learn only from verified blocks: after PROBE_AFTER declined
            # rounds a block is drafted anyway, so they can recover.
            self.declined += 1
            if self.declined < PROBE_AFTER:
                self.declined_total += 1
                return None
            k = limit
        self.declined = 0
        ids = mx.array([history[-1]] + [self.mask] * (self.block - 1))
        hidden = self.module(self.embed(ids)[None], n - 1, self.caches)[0, 1 : 1 + k]
        logits = self.head.logits(hidden, context=history)  # [k, V]
        greedy = self.sampler.is_greedy
        draft = specdec.drafting.draft_lazily(
            k, lambda i, _prev: logits[i : i + 1], self.sampler, n, greedy=greedy
        )
        self.last = (n, k)
        self.rounds += 1
        return Draft(tokens=draft.tokens, probs=draft.probs, acceptance=accept[:k])

    def _size(self, accept: list[float], n: int) -> int:
        cost = self.cost
        base, extra = cost.steady_overheads(NAME, n, self.d.overhead_quantum)
        choice = best_block(
            accept,
            lambda width: cost.cost(width, n),
            overhead_s=base,
            draft_cost=lambda k: extra,
        )
        return choice.size

    def observe(self, result: RoundResult) -> None:
        """Keep the features of the tokens committed before the bonus token; learn the
        outcome of our block."""
        start = result.start_position
        if self.last is not None and self.last[0] == start and result.drafter == NAME:
            k, a = len(result.block), result.n_accepted  # the block as verified (maybe cut)
            self.estimate.observe(k, a)
            self.accepted += a
            self.proposed += k
            self.sizes[k] = self.sizes.get(k, 0) + 1
        self.last = None
        v = result.verify
        if v is not None:
            self._add(start - 1, self._features(v.layers)[: result.n_accepted + 1])

    def end(self) -> None:
        """Drop the context cache and pending features."""
        self.caches = []
        self.pending = []
        self.pending_n = 0

    def stats(self) -> dict:
        """Rounds, drafted and accepted tokens, block sizes, per-position acceptance."""
        return {
            "dflash_rounds": self.rounds,
            "dflash_proposed": self.proposed,
            "dflash_accepted": self.accepted,
            "dflash_declined": self.declined_total,
            "sizes": dict(sorted(self.sizes.items())),
            "acceptance": self.estimate.to_dict(self.block - 1),
            "context_from": self.first,
            "feature_gaps": self.gaps,
            "dflash": dict(self.d.info),
        }


def create_dflash(**options: Any) -> DFlashDrafter:
    """The ``dflash`` drafter's factory (the entry point's registration)."""
    return DFlashDrafter(**options)
