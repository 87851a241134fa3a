"""Grammar-constrained decoding: a request's output held to a JSON schema, a regular
expression or a Lark grammar, under speculation too.

The grammar engine is llguidance (its ``LLMatcher``: a token-level matcher that computes
the allowed next tokens as a bitmask, consumes tokens, rolls back any number of them, and
computes the tokens the grammar forces). The round phases use it like this:

- **forced tokens** (:meth:`GrammarState.forced`): where the grammar allows exactly one
  continuation, its tokens open the round's block; they cannot be rejected (their
  verify rows are masked to that one token);
- **truncation** (:meth:`GrammarState.advance`): the matcher walks the block, filling
  one mask row per position; the first token the row's mask forbids (or a stop token)
  ends the block before verify;
- **masks** (:meth:`GrammarState.apply`): every verified position's logits are masked by
  the grammar's state after the block's tokens before it, after the logits processors and
  before sampling, so acceptance reads the constrained distribution;
- **commit / undo** (:meth:`GrammarState.commit`, :meth:`GrammarState.undo`): the matcher
  rolls back to the accepted tokens and consumes the round's correction or bonus token,
  with the caches' transaction.

Stop tokens are never fed to the matcher: the mask allows the tokenizer's EOS (and the
request's ``stop_tokens``) only where the grammar may end, and the stream ends there.
"""

from __future__ import annotations

import copy
import importlib
import json
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from .errors import ComponentError, RequestError

__all__ = ["FORCED", "KINDS", "Grammar", "GrammarState", "grammar_tokenizer"]

#: The drafter name a round's block goes by when a grammar's forced tokens are all of it
#: (``RoundResult.drafter``, ``stats.per_drafter``).
FORCED = "grammar"

#: The grammar kinds a request may name (``Request.grammar = {kind: source}``).
KINDS = ("json_schema", "regex", "lark")

#: JSON schema compile options by default: no free whitespace between tokens (a small
#: model can loop on whitespace, and fixed separators are forced tokens). A schema's own
#: ``"x-guidance"`` table overrides them (e.g. ``{"whitespace_flexible": true}``).
JSON_DEFAULTS = {"whitespace_flexible": False}


def _lg() -> Any:
    import llguidance  # noqa: PLC0415 - loaded on the first constrained request only

    return llguidance


@attrs.frozen
class Grammar:
    """A request's grammar: its kind, its source as given (a JSON schema as JSON text),
    and llguidance's grammar text compiled from it.

    Build it with :meth:`of` (what ``Request(grammar=...)`` does).
    """

    kind: str
    source: str
    text: str = attrs.field(repr=False)

    @classmethod
    def of(cls, value: Any) -> Grammar | None:
        """A grammar from ``{"json_schema": schema}`` (a dict or its JSON text),
        ``{"regex": pattern}`` or ``{"lark": grammar}``; ``None`` stays ``None``.

        Raises:
            RequestError: another shape, an invalid schema, regex or grammar (llguidance's
                message), or a feature the engine does not support.
        """
        if value is None or isinstance(value, Grammar):
            return value
        if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in KINDS:
            raise RequestError(
                "grammar must be one of {'json_schema': <schema dict or JSON text>}, "
                f"{{'regex': <pattern>}}, {{'lark': <grammar>}}; got {value!r:.200}"
            )
        kind, src = next(iter(value.items()))
        M = _lg().LLMatcher
        try:
            if kind == "json_schema":
                if isinstance(src, str):
                    src = json.loads(src)
                if not isinstance(src, Mapping):
                    raise RequestError(
                        f"grammar json_schema must be a JSON object (a dict), got {src!r:.200}"
                    )
                source = json.dumps(src, sort_keys=True)
                text = M.grammar_from_json_schema(dict(src), defaults=JSON_DEFAULTS)
            else:
                if not isinstance(src, str) or not src:
                    raise RequestError(
                        f"grammar {kind} must be a non-empty string, got {src!r:.200}"
                    )
                source = src
                text = M.grammar_from_regex(src) if kind == "regex" else M.grammar_from_lark(src)
        except (ValueError, TypeError) as exc:
            raise RequestError(f"grammar {kind} is not valid: {exc}") from exc
        err = M.validate_grammar(text)
        if err:
            raise RequestError(f"grammar {kind} is not valid: {err.strip()}")
        return cls(kind=kind, source=source, text=text)


#: llguidance tokenizers already built, by (tokenizer, n_vocab): pipelines that share a
#: tokenizer (a server's policies) share one (it is immutable and thread-safe).
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's tokenizer for an mlx-lm ``TokenizerWrapper`` (or a Hugging Face fast
    tokenizer), with ``n_vocab`` mask bits (the model's logits width) and the tokenizer's
    EOS ids. It costs a few hundred ms: built once per tokenizer and vocabulary size.

    Raises:
        RequestError: no tokenizer, or one llguidance cannot read (not a fast tokenizer).
    """
    if tokenizer is None:
        raise RequestError("a grammar needs the pipeline's tokenizer, and this one has none")
    try:
        built = _BUILT.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: built for this call alone
        built = {}
    if n_vocab not in built:
        built[n_vocab] = _build_tokenizer(tokenizer, n_vocab)
    return built[n_vocab]


def _build_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = {tokenizer.eos_token_id}
    try:
        # a Hugging Face fast tokenizer's Rust tokenizer (mlx-lm's wrapper forwards the
        # attribute), serialised as llguidance.hf.from_tokenizer does
        backend = copy.copy(tokenizer.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return _lg().LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=sorted(eos) or None)
    except (ValueError, TypeError, AttributeError) as exc:
        raise RequestError(
            f"this tokenizer cannot be used for constrained decoding ({exc}); llguidance "
            "reads Hugging Face fast tokenizers (tokenizer.json)"
        ) from exc


@mx.compile
def _masked(words: mx.array, logits: mx.array) -> mx.array:
    # built here, not at import: a server's worker thread has its own stream
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)
    bits = bits[:, : logits.shape[-1]].astype(mx.bool_)
    return mx.where(bits, logits, mx.array(-mx.inf, dtype=logits.dtype))


class GrammarState:
    """One request's grammar matcher and its mask rows.

    Invariant between rounds: the matcher has consumed exactly the request's committed
    output tokens, stop tokens left out (:attr:`consumed`).

    Args:
        ltok: llguidance's tokenizer (:func:`grammar_tokenizer`).
        grammar: the request's grammar.
        stop_ids: the request's stop token ids (the tokenizer's EOS ids and
            ``stop_tokens``).

    Raises:
        RequestError: the grammar does not compile for this tokenizer, or it cannot be
            rolled back (a Lark ``max_tokens=`` / ``stop=`` lexeme).
    """

    def __init__(self, ltok: Any, grammar: Grammar, stop_ids: frozenset[int]):
        lg = _lg()
        err = lg.LLMatcher.validate_grammar(grammar.text, ltok)
        if err:
            raise RequestError(f"grammar {grammar.kind} is not valid: {err.strip()}")
        limits = lg.LLParserLimits(verbose_errors=False)
        self.matcher = lg.LLMatcher(ltok, grammar.text, log_level=0, limits=limits)
        if self.matcher.is_error():
            raise RequestError(f"grammar {grammar.kind} is not valid: {self.matcher.get_error()}")
        self.grammar = grammar
        self.vocab = int(ltok.vocab_size)
        self.words = (self.vocab + 31) // 32
        self.eos = frozenset(int(t) for t in ltok.eos_tokens)
        self.stops = frozenset(stop_ids)
        self._extra = sorted(t for t in self.stops - self.eos if 0 <= t < self.vocab)
        self._np = importlib.import_module("llguidance.numpy")
        self.rows = np.full((17, self.words), -1, dtype=np.int32)
        #: tokens the matcher has consumed (the committed output, stop tokens left out).
        self.consumed = 0
        #: tokens of the round in flight the matcher was advanced through.
        self.advanced = 0
        #: mask rows filled for the round in flight.
        self.filled = 0
        #: seconds spent filling masks and walking blocks.
        self.time_s = 0.0
        self._probe()

    def _probe(self) -> None:
        """Refuse a grammar the matcher cannot roll back (speculation rolls it back)."""
        probe = self.matcher.deep_copy()
        row = np.full((1, self.words), -1, dtype=np.int32)
        self._np.fill_next_token_bitmask(probe, row, 0)
        allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
        tok = next((int(t) for t in allowed if t < self.vocab and t not in self.stops), None)
        if tok is not None and probe.consume_token(tok) and not probe.rollback(1):
            raise RequestError(
                f"grammar {self.grammar.kind} cannot be rolled back ({probe.get_error()}); "
                "a Lark grammar with max_tokens= or stop= lexemes is not supported"
            )

    # -- one round ----------------------------------------------------------------

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next (at most ``limit``; none is a stop token)."""
        if limit < 1 or self.matcher.is_stopped():
            return []
        ff = [int(t) for t in self.matcher.compute_ff_tokens()[:limit]]
        for i, t in enumerate(ff):
            if t in self.stops:
                return ff[:i]
        return ff

    def _fill(self, i: int) -> np.ndarray:
        if i >= self.rows.shape[0]:
            grown = np.full((max(2 * self.rows.shape[0], i + 1), self.words), -1, np.int32)
            grown[: self.rows.shape[0]] = self.rows
            self.rows = grown
        self._np.fill_next_token_bitmask(self.matcher, self.rows, i)
        row = self.rows[i]
        if self._extra and any((row[t >> 5] >> (t & 31)) & 1 for t in self.eos if t < self.vocab):
            for t in self._extra:  # the request's stop tokens end it where EOS may
                row[t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        self.filled = i + 1
        return row

    def allows(self, i: int, token: int) -> bool:
        """Whether mask row ``i`` (filled this round) allows ``token``."""
        return 0 <= token < self.vocab and bool((self.rows[i, token >> 5] >> (token & 31)) & 1)

    def advance(self, block: Sequence[int]) -> int:
        """Walk the round's block: fill mask row ``i`` for each position and consume the
        block's tokens while the rows allow them (a stop token, or the first token its row
        forbids, ends the walk); then fill the row after the last one consumed.

        Returns:
            how many of the block's tokens the grammar allows in a row (the block is cut
            there); the matcher stays advanced by as many until :meth:`commit` /
            :meth:`undo`.
        """
        t0 = time.perf_counter()
        try:
            return self._advance(block)
        finally:
            self.time_s += time.perf_counter() - t0

    def _advance(self, block: Sequence[int]) -> int:
        self.advanced = 0
        for i, t in enumerate(block):
            self._fill(i)
            t = int(t)
            if t in self.stops or not self.allows(i, t):
                return self.advanced
            if not self.matcher.consume_token(t):  # the row allowed it: an engine fault
                raise ComponentError(
                    f"grammar engine refused token {t}, which its mask allowed: "
                    f"{self.matcher.get_error()}",
                    role="grammar",
                )
            self.advanced += 1
        self._fill(len(block))
        return self.advanced

    def apply(self, logits: mx.array, first: int = 0) -> mx.array:
        """``logits`` (``[rows, vocab]``, row ``i`` judging the token after the block's
        first ``first + i``) masked by the rows :meth:`advance` filled (disallowed:
        ``-inf``)."""
        n = logits.shape[0]
        if first + n > self.filled:
            raise ComponentError(
                f"grammar masks: rows {first}..{first + n - 1} asked for, {self.filled} filled",
                role="grammar",
            )
        words = mx.array(self.rows[first : first + n]).view(mx.uint32)
        return _masked(words, logits)

    def renormalise(self, q: mx.array) -> mx.array:
        """Draft probabilities ``q`` (``[k, vocab]``, row ``i`` drawn after the block's
        first ``i`` tokens) conditioned on the grammar's mask rows: a drafted token the
        mask forbids ends the block, as a drafted stop token does, so the drafts verified
        were drawn from ``q`` inside the mask, stop tokens left out. Rejection sampling
        against the masked target needs exactly that ``q`` to keep the constrained
        distribution."""
        k = q.shape[0]
        rows = self.rows[:k].copy()
        for t in self.stops:  # a drafted stop token ends the block too: not in q's support
            if 0 <= t < self.vocab:
                rows[:, t >> 5] &= ~np.int32(np.uint32(1 << (t & 31)).view(np.int32))
        words = mx.array(rows).view(mx.uint32)
        kept = _masked(words, q.astype(mx.float32))
        kept = mx.where(mx.isinf(kept), 0.0, kept)
        total = kept.sum(axis=-1, keepdims=True)
        return mx.where(total > 0, kept / mx.maximum(total, 1e-30), q.astype(mx.float32))

    def commit(self, n_accepted: int, token: int) -> None:
        """The round committed ``n_accepted`` of the block and ``token``: the matcher rolls
        back the rest it was advanced through and consumes ``token`` (unless it is a stop
        token).

        Raises:
            ComponentError: the matcher refused (the committed token was masked out).
        """
        m = self.matcher
        back = self.advanced - n_accepted
        if back < 0 or (back and not m.rollback(back)):
            raise ComponentError(
                f"grammar rollback of {back} tokens failed: {m.get_error()}", role="grammar"
            )
        self.consumed += n_accepted
        self.advanced = 0
        if int(token) not in self.stops:
            if not m.consume_token(int(token)):
                raise ComponentError(
                    f"grammar refused committed token {token}: {m.get_error()}", role="grammar"
                )
            self.consumed += 1

    def undo(self) -> None:
        """The round in flight failed: the matcher goes back to the committed tokens."""
        if self.advanced:
            self.matcher.rollback(self.advanced)
            self.advanced = 0

    @property
    def finished(self) -> bool:
        """The grammar is complete: only a stop token may follow."""
        return bool(self.matcher.is_stopped())
