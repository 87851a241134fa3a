"""The speculative loop: draft → verify → accept → roll back → emit.

:func:`assemble` resolves a :class:`~specdec.policy.Policy` against the
installed plugins once and returns a :class:`Pipeline`; each
:meth:`Pipeline.stream` call is one request. Per-request state lives in a
:class:`_Row` so batched decoding can hold several rows.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_logits_processors

from .acceptors import auto_acceptor
from .attention import verify_attention
from .composition import check_batch, check_needs
from .costs import CostModel
from .distributed import (
    SHARDING_KINDS,
    START,
    DistributedError,
    RankSync,
    adopt_sharding,
    launched_world,
    looks_sharded,
    model_sharding,
    shard_model,
)
from .errors import ModelLoadError, PolicyError, RequestError, UnknownComponentError
from .heads import model_vocab_size
from .plugins import PluginHost, get_plugin_host
from .policy import AUTO, DEFAULT_POLICY, Policy, load_policy
from .roles import (
    Acceptance,
    PrefillChunk,
    RequestContext,
    RoundResult,
    VerifyResult,
)
from .rollback import RollbackPlan, build_plan
from .sampling import Sampler, validate_request
from .stats import Stats

__all__ = [
    "GenerationResult",
    "Pipeline",
    "StreamResponse",
    "assemble",
    "validate_request",
]


@attrs.frozen
class StreamResponse:
    """One committed token.

    Attributes:
        text: the new text segment (incrementally detokenized; may be empty).
        token: the token id.
        from_draft: whether the token was a drafted token that the target accepted.
        position: absolute position of the token.
        finish_reason: ``None``, or ``"stop"``/``"length"`` on the last response.
        stats: the request's :class:`Stats` (final on the last response).
        is_stop_token: the last response of a stream ended by a stop token carries
            that token here; it is not part of the output (as in mlx-lm).
    """

    text: str
    token: int
    from_draft: bool
    position: int
    finish_reason: str | None = None
    stats: Stats | None = None
    is_stop_token: bool = False


@attrs.frozen
class GenerationResult:
    """The whole output of :meth:`Pipeline.generate` (``tokens`` excludes a final stop token)."""

    text: str
    tokens: list
    stats: Stats
    finish_reason: str | None


class _NaiveDetokenizer:
    """Incremental text for tokenizers without mlx-lm's streaming detokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.last_segment = ""

    def reset(self) -> None:
        self.tokens, self.text, self.last_segment = [], "", ""

    def add_token(self, tok: int) -> None:
        self.tokens.append(tok)
        if self.tokenizer is None:
            self.last_segment = ""
            return
        new = self.tokenizer.decode(self.tokens)
        if new.endswith("\ufffd"):  # incomplete UTF-8: wait for more bytes
            self.last_segment = ""
            return
        self.last_segment, self.text = new[len(self.text) :], new

    def finalize(self) -> None:
        if self.tokenizer is None:
            self.last_segment = ""
            return
        new = self.tokenizer.decode(self.tokens)
        self.last_segment, self.text = new[len(self.text) :], new


@attrs.define
class _Row:
    """Per-request (per batch row) state."""

    history: list
    sampler: Sampler
    caches: list
    stats: Stats
    processors: list
    stop_ids: frozenset
    stop_strings: tuple
    max_tokens: int
    n_out: int = 0
    text: str = ""
    pending: str = ""
    #: ``[(drafter name, session)]`` in policy order (empty: plain decoding).
    sessions: list = attrs.field(factory=list)
    governor: Any = None
    #: the history as an ``mx.array`` (kept only when logits processors need it).
    hist_arr: Any = None
    #: prompt tokens per prefill forward.
    prefill_step: int = 512
    #: the incremental detokenizer and the cost model in use (set by ``_open``).
    detok: Any = None
    cost: Any = None
    #: seconds the stream spent suspended at its yields (its consumer's time, or other
    #: streams'), left out of the round times the cost model learns from.
    away_s: float = 0.0
    #: the request's state in the ranks' synchronisation (a sharded model only).
    sync: Any = None
    #: prefill forwards (a sharded model's prefill collectives).
    prefill_forwards: int = 0


#: Rounds in a row without a draft after which the next round is queued ahead, as a
#: plain step (see :meth:`Pipeline._start_lookahead`).
_IDLE_LOOKAHEAD = 2

#: Built-in acceptors that, for an empty block, emit the plain sample of the position
#: (``Sampler.sample`` with the position's key): the lazy sample a lookahead was fed.
_PLAIN_WHEN_EMPTY = frozenset({"greedy", "point_mass", "rejection"})


@attrs.define
class _Round:
    """One round in flight: what was fed, the lazy verify result, the open transaction."""

    position: int
    block: Any = ()
    q: Any = None
    chosen: str | None = None
    proposals: dict = attrs.field(factory=dict)
    shadows: dict = attrs.field(factory=dict)
    acceptor: str | None = None
    txn: Any = None
    vr: Any = None
    logits: Any = None
    lazy_token: Any = None
    n_fed: int = 1
    t_launch: float = 0.0
    #: a lookahead round: the lazily sampled token of the round before, which it was fed.
    fed_token: Any = None
    #: the transaction was committed when the lookahead after it was queued.
    committed: bool = False
    #: the lazily sampled token of a round that drafted nothing (a lookahead was fed it).
    lazy_sample: Any = None
    #: the verifier's ``project_row(i)`` when the round's logits are projected row by row
    #: until the first rejection (greedy, no processors); ``logits`` is then unevaluated.
    rows: Any = None


def _joined(a: VerifyResult, b: VerifyResult) -> VerifyResult:
    """One verify result for two forwards in a row (a lookahead, then a block on it)."""

    def cat(x: Any, y: Any) -> Any:
        return None if x is None or y is None else mx.concatenate([x, y], axis=0)

    return VerifyResult(
        logits=cat(a.logits, b.logits),
        hidden=cat(a.hidden, b.hidden),
        layers={k: cat(v, b.layers[k]) for k, v in a.layers.items() if k in b.layers},
        # project_row's row indices are b's alone (an extended round uses all the logits)
        extras={k: v for k, v in b.extras.items() if k != "project_row"},
    )


def _is_lazy(block: Any) -> bool:
    return not isinstance(block, tuple)


class Pipeline:
    """A target model plus the components a policy names.

    Build it with :func:`assemble`. Components are created once here (so bad
    names and options fail before any model work); each request gets fresh
    drafter and governor sessions.
    """

    def __init__(
        self, model: Any, tokenizer: Any, policy: Policy, *, host: PluginHost | None = None
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.policy = policy
        self.host = host or get_plugin_host()
        h = self.host
        self.drafters = [h.create("drafter", n, policy.options_for(n)) for n in policy.drafters]
        for d in self.drafters:
            if not getattr(d, "name", None):
                raise PolicyError(f"drafter {d!r} has no name attribute")
            if not callable(getattr(d, "session", None)):
                info = h.get("drafter", d.name)
                raise PolicyError(
                    f"drafter {d.name!r} ({info.distribution} {info.version}) has no "
                    "session(ctx) method: specdec-core 0.2 keeps per-request state in a "
                    "session the drafter makes per request (see docs/writing-plugins.md)"
                )
            check_needs(h, policy, d.name, getattr(d, "needs", ()))
        self.governor = (
            h.create("governor", policy.governor, policy.options_for(policy.governor))
            if policy.governor
            else None
        )
        if self.governor is not None and not callable(getattr(self.governor, "session", None)):
            raise PolicyError(
                f"governor {policy.governor!r} has no session(ctx) method: specdec-core 0.2 "
                "keeps per-request state in a session the governor makes per request"
            )
        self.verifier = h.create("verifier", policy.verifier, policy.options_for(policy.verifier))
        if "logits" not in getattr(self.verifier, "provides", frozenset({"logits"})):
            raise PolicyError(f"verifier {policy.verifier!r} does not provide logits")
        layers = [i for d in self.drafters for i in getattr(d, "hidden_layers", ())]
        bind = getattr(self.verifier, "bind", None)
        if bind is not None:
            bind(model, layers=tuple(layers))
        elif layers:
            raise PolicyError(
                f"drafters ask for decoder layers {layers} but verifier {policy.verifier!r} "
                "cannot be told which layers to capture (it has no bind(model, layers=...))"
            )
        #: The ranks' synchronisation when the model is sharded across processes.
        self.sharding = model_sharding(model)
        if self.sharding is None and looks_sharded(model):
            # sharded elsewhere (mlx-lm's sharded_load) and handed to Pipeline directly
            world = launched_world()
            if world is None:
                raise PolicyError(
                    "the model is sharded (its forward issues collectives) but this process is "
                    "not one of several ranks: run it under mlx.launch"
                )
            self.sharding = adopt_sharding(model, world)
        self.ranks = (
            RankSync(self.sharding, policy.max_block, self.drafters)
            if self.sharding is not None
            else None
        )
        #: Whether idle rounds may be queued ahead (no drafter reads the caches in
        #: propose, the model is not sharded; see :meth:`_start_lookahead`).
        self._lookahead = self.ranks is None and not any(
            "kv" in getattr(d, "needs", ()) for d in self.drafters
        )
        #: draft heads by drafter name (shared: built once per (model, head, options)).
        self.heads: dict[str, Any] = {}
        for d in self.drafters:
            head_name = getattr(d, "head", None)
            if head_name:
                self.heads[d.name] = self._head(d, head_name)
        self._acceptors: dict[str, Any] = {}
        if policy.acceptor != AUTO:
            self._acceptors[policy.acceptor] = h.create(
                "acceptor", policy.acceptor, policy.options_for(policy.acceptor)
            )
        else:
            for n in ("greedy", "point_mass", "rejection"):
                self._acceptors[n] = h.create("acceptor", n)
        if policy.rollback != AUTO:
            h.get("cache_rollback", policy.rollback)
        for d in self.drafters:
            attach = getattr(d, "attach", None)
            if attach is not None:
                attach(model, tokenizer)
        #: the verify cost curve of this model on this device, when a drafter reads it.
        self.cost_model: CostModel | None = None
        if self.ranks is None and any(getattr(d, "uses_verify_cost", False) for d in self.drafters):
            # Profiled with the built-in logits verifier: the cost of the model's own
            # forward, whatever verifier the policy names (a plugin's verifier may keep
            # state that profiling forwards must not touch).
            self.cost_model = CostModel(model, None, host=h)

    def prepare(self, progress: Callable[[int, int, str], None] | None = None) -> None:
        """Do the one-off work before the first request: load the verify cost curve, or
        profile it (seconds, once per model and device; ``progress(done, total, label)``
        is told how far it got). Requests call it themselves when it was not called."""
        if self.cost_model is not None and not self.cost_model.loaded:
            if progress is not None:
                self.cost_model.progress = progress
            self.cost_model.curve()

    def _head(self, d: Any, name: str) -> Any:
        drafter = d.name
        try:
            self.host.get("draft_head", name)
        except UnknownComponentError as exc:
            raise PolicyError(f"drafter {drafter!r}: option head: {exc}") from exc
        # A drafter with a model of its own (a draft model) names it as head_model: the
        # head reads that model's output layer; else the target's.
        model = getattr(d, "head_model", None)
        own = model is not None
        if not own:
            model = self.model
        # A drafter's own model shares the target's vocabulary (checked in attach), so
        # the pipeline's tokenizer stands in when the drafter has none of its own.
        tokenizer = (getattr(d, "head_tokenizer", None) if own else None) or self.tokenizer
        head = self.host.draft_head(name, self.policy.options_for(name), model, tokenizer)
        tv, hv = model_vocab_size(self.model), getattr(head, "vocab_size", None)
        if tv is not None and hv is not None and int(hv) != tv:
            raise ModelLoadError(
                f"draft head {name!r} (for drafter {drafter!r}) scores a vocabulary of {hv} "
                f"tokens but the target's has {tv}: a draft head must cover the target's vocabulary"
            )
        return head

    # -- prompts -------------------------------------------------------------------

    def encode_prompt(
        self, text: str, *, chat_template: bool = True, system_prompt: str | None = None
    ) -> list[int]:
        """Tokenize ``text``, through the tokenizer's chat template when it has one and ``chat_template``."""
        if self.tokenizer is None:
            raise RequestError(
                "this pipeline has no tokenizer: pass the prompt as a list of token ids"
            )
        if chat_template and getattr(self.tokenizer, "chat_template", None):
            messages = []
            if system_prompt:
                messages.append({"role": "system", "content": system_prompt})
            messages.append({"role": "user", "content": text})
            return self.encode_messages(messages)
        return [int(t) for t in self.tokenizer.encode(text)]

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """Prompt ids of chat ``messages`` (``{"role", "content"}`` dicts) through the
        tokenizer's chat template, with the generation prompt added.

        Raises:
            RequestError: no tokenizer, or a tokenizer without a chat template.
            Exception: whatever the template raises for messages it refuses (jinja's
                ``TemplateError``, for example).
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this pipeline's tokenizer has no chat template: pass a plain prompt instead"
            )
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    "this pipeline has no tokenizer: pass the prompt as a list of token ids"
                )
            ids = [int(t) for t in self.tokenizer.encode(prompt)]
        else:
            try:
                ids = [int(t) for t in prompt]
            except (TypeError, ValueError) as exc:
                raise RequestError(
                    f"prompt must be a string or a sequence of token ids, got {prompt!r}"
                ) from exc
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        v = model_vocab_size(self.model)
        if v is not None:
            bad = [t for t in ids if t < 0 or t >= v]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {v}); got {bad[:5]}")
        return ids

    # -- requests -------------------------------------------------------------------

    def check_request(
        self,
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        min_tokens_to_keep: int = 1,
        stop: Sequence[str] | None = None,
        prefill_step_size: int = 512,
        **_ignored: Any,
    ) -> None:
        """Check a request's arguments as :meth:`stream` does before any model work, for
        callers that must refuse a request before queueing it (a server). Arguments it
        does not check (the prompt, seed, processors) are ignored.

        Raises:
            RequestError: naming the bad argument and what is accepted.
        """
        validate_request(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            min_tokens_to_keep=min_tokens_to_keep,
        )
        if stop is not None and (
            isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop)
        ):
            raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
        if (
            prefill_step_size is None
            or isinstance(prefill_step_size, bool)
            or not (isinstance(prefill_step_size, int) and prefill_step_size >= 1)
        ):
            raise RequestError(
                f"prefill_step_size must be an integer >= 1, got {prefill_step_size!r}"
            )
        if self.policy.acceptor == "greedy" and temperature > 0:
            raise RequestError(
                f"policy {self.policy.name!r} names acceptor 'greedy', which is only exact with "
                f"temperature 0 (got temperature={temperature}); use acceptor 'auto', "
                "'point_mass' or 'rejection' for sampling"
            )

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        """Run :meth:`stream` to the end; same arguments."""
        tokens: list[int] = []
        text = []
        last = None
        for r in self.stream(prompt, **kwargs):
            if not r.is_stop_token:
                tokens.append(r.token)
            text.append(r.text)
            last = r
        assert last is not None
        return GenerationResult(
            text="".join(text), tokens=tokens, stats=last.stats, finish_reason=last.finish_reason
        )

    def batch(self, max_rows: int | None = None) -> Any:
        """A :class:`specdec.Batch` of up to ``max_rows`` rows (default: the policy's
        ``max_batch``) for continuous batching: ``add`` requests, ``step`` rounds.

        Raises:
            PolicyError: a component of the policy cannot run rows of a batch.
        """
        from .batch import Batch

        if self.ranks is not None:
            raise PolicyError(
                f"batched decoding is not supported on a model sharded across "
                f"{self.sharding.ranks} ranks yet; decode one request at a time (Pipeline.stream)"
            )
        return Batch(self, self.policy.max_batch if max_rows is None else max_rows)

    def stream_batch(
        self, prompts: Sequence[str | Sequence[int]], *, max_rows: int | None = None, **kwargs: Any
    ) -> Iterator[tuple[int, StreamResponse]]:
        """Decode ``prompts`` together as the rows of one forward per round, yielding
        ``(index of the prompt, StreamResponse)`` as tokens are committed.

        Every row has its own drafter and governor sessions, sampler and stop set,
        and accepts on its own; rows that finish leave the batch and waiting prompts
        join it. Each row's output is that prompt's output alone.

        Args:
            prompts: texts or token-id lists.
            max_rows: rows decoded at once (default: all the prompts).
            kwargs: as :meth:`stream` (but ``on_round``), the same for every prompt;
                for per-request arguments use :meth:`batch`.

        Raises:
            RequestError: a bad argument, before any model work.
            PolicyError: a component of the policy cannot run rows of a batch.
            Exception: the first error of a row (the other rows end with it).
        """
        from .batch import stream_rows

        prompts = list(prompts)
        if not prompts:
            raise RequestError("stream_batch needs at least one prompt")
        batch = self.batch(len(prompts) if max_rows is None else max_rows)
        return stream_rows(batch, prompts, kwargs)

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], **kwargs: Any
    ) -> list[GenerationResult]:
        """Run :meth:`stream_batch` to the end; one result per prompt, in order."""
        tokens: list[list[int]] = [[] for _ in prompts]
        text: list[list[str]] = [[] for _ in prompts]
        last: list[Any] = [None] * len(prompts)
        for i, r in self.stream_batch(prompts, **kwargs):
            if not r.is_stop_token:
                tokens[i].append(r.token)
            text[i].append(r.text)
            last[i] = r
        return [
            GenerationResult(
                text="".join(t), tokens=k, stats=r.stats, finish_reason=r.finish_reason
            )
            for t, k, r in zip(text, tokens, last)
        ]

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        min_tokens_to_keep: int = 1,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_tokens: Sequence[int] | None = None,
        logits_processors: Sequence[Callable[[mx.array, mx.array], mx.array]] | None = None,
        repetition_penalty: float | None = None,
        repetition_context_size: int = 20,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        prefill_step_size: int = 512,
        on_round: Callable[[RoundResult, list], None] | None = None,
    ) -> Iterator[StreamResponse]:
        """Generate up to ``max_tokens`` tokens after ``prompt``, yielding each as it is committed.

        Args:
            prompt: text (tokenized without chat template; see :meth:`encode_prompt`) or token ids.
            max_tokens: exact maximum of emitted tokens (>= 1).
            temperature, top_p, top_k, min_p, min_tokens_to_keep: sampling, as in mlx-lm.
            seed: seed of the position-keyed sampler (random if ``None``).
            stop: stop strings; the stream ends when the text contains one (the text is cut before it).
            stop_tokens: extra stop token ids besides the tokenizer's EOS set.
            logits_processors: mlx-lm style ``processor(tokens, logits) -> logits`` callables,
                applied at every verified position with that position's token history.
            repetition_penalty, repetition_context_size, presence_penalty, frequency_penalty,
                logit_bias: as mlx-lm's ``make_logits_processors``.
            prefill_step_size: prompt tokens per prefill forward.
            on_round: debug hook called after each round (plain or speculative: the same
                loop) with ``(RoundResult, caches)``, the caches committed and holding
                every committed token but the last. Plain decoding queues its next
                forward before reading a token back; with ``on_round`` it queues it
                after the hook, so the hook never sees the next round's entries.

        Yields:
            :class:`StreamResponse` per committed token; the last has ``finish_reason`` and final ``stats``.

        Raises:
            RequestError: bad arguments, before any model work.
        """
        args = dict(locals())  # the request's arguments (first statement: nothing else yet)
        for name in ("self", "prompt", "on_round"):
            del args[name]
        row = self._new_row(prompt, **args)
        return self._run(row, on_round)

    def _new_row(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        min_tokens_to_keep: int = 1,
        seed: int | None = None,
        stop: Sequence[str] | None = None,
        stop_tokens: Sequence[int] | None = None,
        logits_processors: Sequence[Callable[[mx.array, mx.array], mx.array]] | None = None,
        repetition_penalty: float | None = None,
        repetition_context_size: int = 20,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
        logit_bias: dict[int, float] | None = None,
        prefill_step_size: int = 512,
    ) -> _Row:
        """A request's row: its arguments checked (before any model work), its prompt
        tokenized, its sampler and processors built, fresh caches; no session yet."""
        self.check_request(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            min_tokens_to_keep=min_tokens_to_keep,
            stop=stop,
            prefill_step_size=prefill_step_size,
        )
        ids = self._prompt_ids(prompt)
        sampler = Sampler(
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=int(top_k),
            min_p=float(min_p),
            min_tokens_to_keep=min_tokens_to_keep,
            seed=seed,
        )
        processors = list(logits_processors or []) + make_logits_processors(
            logit_bias,
            repetition_penalty,
            repetition_context_size,
            presence_penalty,
            20,
            frequency_penalty,
            20,
        )
        eos = set(getattr(self.tokenizer, "eos_token_ids", None) or ())
        if not eos and getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos = {self.tokenizer.eos_token_id}
        stop_ids = frozenset(eos | {int(t) for t in (stop_tokens or ())})
        row = _Row(
            history=ids,
            sampler=sampler,
            caches=make_prompt_cache(self.model),
            stats=Stats(
                policy=self.policy.name, prompt_tokens=len(ids), verifier=self.verifier.name
            ),
            processors=processors,
            stop_ids=stop_ids,
            stop_strings=tuple(stop or ()),
            max_tokens=max_tokens,
            prefill_step=prefill_step_size,
        )
        return row

    def _verify(self, tokens: mx.array, caches: list) -> VerifyResult:
        """The verifier's forward over ``tokens``, with the CPU's verify attention
        (:mod:`specdec.attention`: MLX's own result, bit for bit, in less time)."""
        with verify_attention():
            return self.verifier.verify(self.model, tokens, caches)

    def _run(self, row: _Row, on_round: Callable | None) -> Iterator[StreamResponse]:
        if self.ranks is not None:
            yield from self._run_ranked(row, on_round)
            return
        try:
            plan = self._open(row)
            t0 = time.perf_counter()
            self._prefill(row, row.prefill_step)
            row.stats.prompt_time_s = time.perf_counter() - t0
            yield from self._decode(row, plan, row.detok, on_round)
        finally:
            self._close(row)

    def _run_ranked(self, row: _Row, on_round: Callable | None) -> Iterator[StreamResponse]:
        """A request on a sharded model: as :meth:`_run`, with the ranks kept in step
        (see :mod:`specdec.distributed`): rank 0's seed, one synchronisation before each
        verify forward and one at the end; a failure on this rank completes the forward
        the other ranks run and tells them at their next synchronisation."""
        ranks = self.ranks
        st = row.sync = ranks.open()
        s = row.sampler
        request = [
            row.max_tokens,
            round(s.temperature * 1e6),
            round(s.top_p * 1e6),
            s.top_k,
            round(s.min_p * 1e6),
            s.min_tokens_to_keep,
            len(row.stop_ids),
            *sorted(row.stop_ids)[:8],
            len(row.stop_strings),
            len(row.processors),
            row.prefill_step,
        ]
        try:
            seed = ranks.start(st, row.history, request, s.seed)
            row.sampler = attrs.evolve(s, seed=seed)
            try:
                plan = self._open(row)
            except BaseException as exc:
                ranks.fail(st, row.history, exc, phase=START)
                raise
            ranks.opened(st, row.history, len(row.sessions))
            t0 = time.perf_counter()
            self._prefill(row, row.prefill_step)
            row.stats.prompt_time_s = time.perf_counter() - t0
            yield from self._decode(row, plan, row.detok, on_round)
            ranks.finish(st, row.history)
        except DistributedError:
            raise  # raised alike on every rank at a synchronisation: nothing owed
        except GeneratorExit:
            ranks.fail(st, row.history, None)
            raise
        except BaseException as exc:
            ranks.fail(st, row.history, exc, rerun=self._rerun)
            raise
        finally:
            self._close(row)

    def _rerun(self, tokens: Sequence[int]) -> None:
        """A forward of the model over ``tokens`` without caches, for a rank that owes the
        other ranks a forward it never built (it failed after the round's
        synchronisation, or part-way through building it): the collectives stay paired
        (their shapes depend only on how many tokens are fed), and nothing depends on
        caches a failed forward may have half-written."""
        mx.eval(self.model(mx.array([list(tokens)])))

    def _open(
        self,
        row: _Row,
        *,
        off_reason: str | None = None,
        row_id: int = 0,
        reset_peak: bool = True,
    ) -> RollbackPlan:
        """Open a request: its rollback plan, detokenizer, cost curve and the drafter and
        governor sessions (none when speculation is off for it: the policy has no
        drafters, a cache cannot be rolled back, or ``off_reason`` says why not).
        Call :meth:`_close` after it, also when it raised."""
        policy, stats, caches = self.policy, row.stats, row.caches
        plan = build_plan(self.host, caches, model=self.model, policy=policy)
        stats.rollbacks = plan.names()
        drafters = list(self.drafters)
        if not drafters:
            stats.speculation_off_reason = f"policy {policy.name!r} has no drafters"
        elif not plan.ok:
            stats.speculation_off_reason = plan.reason
            drafters = []
        elif off_reason is not None:
            stats.speculation_off_reason = off_reason
            drafters = []
        detok = getattr(self.tokenizer, "detokenizer", None) if self.tokenizer is not None else None
        if detok is None:
            detok = _NaiveDetokenizer(self.tokenizer)
        detok.reset()
        row.detok = detok

        cost = self.cost_model if drafters else None
        if cost is not None:
            # Load (or profile) the curve, a longer context too when requests ran past
            # twice the longest profiled one; before the peak memory is reset, so that
            # profiling is not counted as this request's memory. A curve that cannot be
            # measured does not fail the request: drafters get no ctx.cost (ngram_copy
            # then sizes by its ladder and says so) and stats.verify_cost has the error.
            try:
                cost.refresh()
            except Exception as exc:  # noqa: BLE001 - reported in stats, never silent
                cost.failure = f"{type(exc).__name__}: {exc}"
            stats.verify_cost = cost.stats()
            if not cost.loaded:
                cost = None
        row.cost = cost
        if reset_peak:  # a row joining a running batch keeps the others' peak
            mx.reset_peak_memory()
        ctx_common = dict(
            model=self.model,
            tokenizer=self.tokenizer,
            prompt_tokens=list(row.history),
            max_tokens=row.max_tokens,
            sampler=row.sampler,
            caches=caches,
            host=self.host,
            verifier=self.verifier,
            plan=plan,
            row=row_id,
        )
        if cost is not None:
            ctx_common["cost"] = cost
        for d in drafters:
            ctx = RequestContext(
                **ctx_common, options=policy.options_for(d.name), head=self.heads.get(d.name)
            )
            row.sessions.append((d.name, d.session(ctx)))
            stats.per_drafter[d.name] = {"rounds": 0, "drafted": 0, "accepted": 0}
        if self.governor is not None and drafters:
            row.governor = self.governor.session(
                RequestContext(**ctx_common, options=policy.options_for(policy.governor))
            )
        return plan

    @staticmethod
    def _close(row: _Row) -> None:
        """End a request's sessions (errors while ending never mask the request's own)."""
        if row.cost is not None:
            row.cost.note_context(len(row.history))
            row.cost = None
        for _, s in row.sessions:
            try:
                s.end()
            except Exception:  # ending must not mask the real error
                pass
        row.sessions = []
        end = getattr(row.governor, "end", None)
        row.governor = None
        if end is not None:
            try:
                end()
            except Exception:
                pass

    def _prefill(self, row: _Row, step: int) -> None:
        """Feed the prompt but its last token through the verifier, in chunks of ``step``;
        sessions with a ``prefill`` method see every chunk's result (hidden states too)."""
        prompt, caches = row.history, row.caches
        listeners = [s.prefill for _, s in row.sessions if callable(getattr(s, "prefill", None))]
        failed: BaseException | None = None
        for start in range(0, len(prompt) - 1, step):
            chunk = prompt[start : min(start + step, len(prompt) - 1)]
            row.prefill_forwards += 1
            if failed is not None:
                # A sharded model's ranks feed every chunk (their collectives pair up);
                # this rank failed on an earlier one and says so at the first round.
                self._rerun(chunk)
                continue
            vr = None
            try:
                vr = self._verify(mx.array(chunk), caches)
                if listeners:
                    record = PrefillChunk(tokens=tuple(chunk), start_position=start, result=vr)
                    for listen in listeners:
                        listen(record)
                # The chunk's logits are never read: only the caches are evaluated.
                mx.eval([c.state for c in caches])
            except Exception as exc:
                if self.ranks is None:
                    raise
                failed = exc
                if vr is not None:  # the chunk's forward was built: run it to the end
                    mx.eval(vr.logits)
                else:
                    self._rerun(chunk)
        if failed is not None:
            raise failed

    # -- the loop -------------------------------------------------------------------

    def _decode(
        self, row: _Row, plan: RollbackPlan, detok: Any, on_round: Callable | None
    ) -> Iterator[StreamResponse]:
        """Rounds until the stream ends: plan a block, verify, accept, commit, observe, emit.

        With no drafter sessions every round is a plain step, pipelined as in
        mlx-lm: the next round's forward is queued on the lazily sampled token
        before this round's token is read back (after ``on_round`` when one is given).
        """
        plain = not row.sessions
        t_start = time.perf_counter()
        queued: _Round | None = None
        idle = 0  # rounds in a row that drafted nothing
        # The cost model learns what a drafted round costs beyond its forward from the
        # rounds' wall times (finish to finish); see specdec.costs.RoundOverhead.
        timed = None if plain else row.cost
        t_prev, away_prev = t_start, row.away_s
        drafter: str | None = None  # who drafted the last drafted round
        since = 0  # rounds since it
        while True:
            if queued is None:
                rnd = self._start_round(row, plan, None)
            elif plain:
                rnd = queued
            else:
                rnd = self._adopt(row, plan, queued)
            queued = None
            more = on_round is None and self.ranks is None and row.n_out + 1 < row.max_tokens
            can_queue = (
                more and self._lookahead and not row.processors and row.n_out + 2 < row.max_tokens
            )
            if plain and more:
                queued = self._start_round(row, plan, rnd)
            elif can_queue and rnd.chosen is None and idle >= _IDLE_LOOKAHEAD:
                # Drafting has paused: queue the next round as a plain step now, as
                # plain decoding does, so the host's work overlaps the forward.
                queued = self._start_lookahead(row, plan, rnd)
            ended = True
            try:
                result = self._finish_round(row, rnd)
                if timed is not None:
                    t_now = time.perf_counter()
                    busy = t_now - t_prev - (row.away_s - away_prev)
                    if rnd.chosen is not None:
                        drafter, since = rnd.chosen, 0
                    else:
                        since += 1
                    self._time_round(timed, rnd, busy, drafter, since, can_queue)
                    t_prev, away_prev = t_now, row.away_s
                if queued is not None and queued.fed_token is not None:
                    if int(queued.fed_token.item()) != result.token:
                        # The acceptor drew another token than the lazy sample: undo it.
                        self._undo_lookahead(row, queued)
                        queued = None
                idle = idle + 1 if result.drafter is None else 0
                pos = result.start_position
                self._observe(row, result)
                if on_round is not None:
                    on_round(result, row.caches)
                ended = yield from self._emit(
                    row, list(result.committed), result.n_accepted, pos, detok, t_start
                )
                if row.sync is not None:
                    self.ranks.round_done(row.sync)
            finally:
                # An error, the end of the stream, or a consumer that closed it: undo a
                # round queued ahead (plain decoding's queued step has no transaction).
                if ended and queued is not None and queued.fed_token is not None:
                    self._undo_lookahead(row, queued)
            if ended:
                return

    @staticmethod
    def _time_round(
        cost: CostModel,
        rnd: _Round,
        seconds: float,
        drafter: str | None,
        since: int,
        can_queue: bool,
    ) -> None:
        """Tell the cost model a round's wall time and kind (see RoundOverhead).

        ``drafted``: the round verified a block (of ``rnd.chosen``). ``after_draft``:
        one of the plain steps after a drafted round (``since`` rounds ago, of
        ``drafter``'s) until steps are queued ahead again: the few the loop runs
        unpipelined, and the first one queued ahead, whose forward was mostly run
        while the round before it queued it, so the two together cost what they
        cost. ``plain``: a step queued ahead otherwise. Unpipelined plain steps
        that no draft caused (the first rounds of a request, its last two, rows with
        logits processors) teach nothing. A round's time runs from the end of the
        round before (the first one's from the end of the prefill), less the time
        the stream sat suspended at its yields (its consumer's work)."""
        if rnd.chosen is not None:
            cost.observe_round("drafted", rnd.n_fed, rnd.position, seconds, rnd.chosen)
            return
        queued = rnd.fed_token is not None
        if drafter is not None and since <= _IDLE_LOOKAHEAD + 2 and (queued or can_queue):
            cost.observe_round("after_draft", 1, rnd.position, seconds, drafter)
        elif queued:
            cost.observe_round("plain", 1, rnd.position, seconds)

    @staticmethod
    def _observe(row: _Row, result: RoundResult) -> None:
        """A committed round: the history grows, the sessions and the governor see it."""
        stats = row.stats
        stats.target_forwards += 1
        row.history.extend(result.committed)
        for _, s in row.sessions:
            s.observe(result)
        if row.governor is not None:
            if result.drafter is not None:
                row.governor.observe(result.drafter, len(result.block), result.n_accepted)
            if result.shadows:
                t0 = time.perf_counter()
                row.governor.observe_round(result)
                stats.shadow_time_s += time.perf_counter() - t0
            else:
                row.governor.observe_round(result)

    def _start_round(self, row: _Row, plan: RollbackPlan, after: _Round | None) -> _Round:
        """Choose a block, open the transaction and queue the verify forward (no host sync).

        ``after``: a plain round whose token is not read back yet; this round follows it
        (fed its lazy token).
        """
        sampler = row.sampler
        if not row.sessions:  # a plain step, sampled lazily
            position = len(row.history) + (1 if after is not None else 0)
            tok = after.lazy_token if after is not None else mx.array(row.history[-1:])
            if row.sync is not None:
                self.ranks.round(row.sync, row.history, _Round(position=position))
            logits = self._verify(tok, row.caches).logits
            if row.sync is not None:
                self.ranks.built(row.sync, logits)
            if row.processors:
                if after is None:
                    row.hist_arr = mx.array(row.history)
                else:
                    row.hist_arr = mx.concatenate([row.hist_arr, after.lazy_token])
                for p in row.processors:
                    logits = p(row.hist_arr, logits)
            y = sampler.sample_lazy(logits[-1:], position)
            self._launch(row, y)
            return _Round(position=position, lazy_token=y, t_launch=time.perf_counter())
        rnd = _Round(position=len(row.history))
        self._plan(row, rnd)
        if row.sync is not None:
            self._sync_round(row, rnd)
        self._launch_round(row, plan, rnd)
        return rnd

    def _sync_round(self, row: _Row, rnd: _Round) -> None:
        """A sharded model's round: every rank verifies rank 0's block (the block-size
        histogram counts that one)."""
        sizes = row.stats.block_sizes
        k = 0 if rnd.chosen is None else rnd.block.size if _is_lazy(rnd.block) else len(rnd.block)
        self.ranks.round(row.sync, row.history, rnd)
        k0 = 0 if rnd.chosen is None else len(rnd.block)
        if k0 != k:
            sizes[k] -= 1
            if not sizes[k]:
                del sizes[k]
            sizes[k0] = sizes.get(k0, 0) + 1

    def _plan(self, row: _Row, rnd: _Round) -> None:
        """Ask the governor and the drafters, in policy order, for this round's block."""
        policy = self.policy
        remaining = row.max_tokens - row.n_out
        limit = min(policy.max_block, remaining - 1)
        if limit >= policy.min_block:
            gov = row.governor
            shadows = gov is not None and getattr(gov, "wants_shadows", True)
            for name, s in row.sessions:
                budget = min(gov.budget(name, limit), limit) if gov is not None else limit
                if budget < policy.min_block:
                    shadow = getattr(s, "shadow", None) if shadows else None
                    if shadow is not None:
                        self._shadow(row, rnd, name, shadow, limit)
                    continue
                draft = s.propose(row.history, budget)
                if draft is None or draft.size < policy.min_block:
                    continue
                rnd.proposals[name] = draft.tokens
                rnd.block = draft.tokens[:budget]
                rnd.q = None if draft.probs is None else draft.probs[:budget]
                rnd.chosen = name
                break
        k = 0 if rnd.chosen is None else (rnd.block.size if _is_lazy(rnd.block) else len(rnd.block))
        row.stats.block_sizes[k] = row.stats.block_sizes.get(k, 0) + 1

    def _launch_round(
        self, row: _Row, plan: RollbackPlan, rnd: _Round, on: _Round | None = None
    ) -> None:
        """Open the transaction and queue the verify forward of ``[last, *block]``.

        ``on``: a lookahead that was fed ``last`` already (see :meth:`_adopt`): only the
        block is fed, inside the lookahead's open transaction, and the round's result is
        the lookahead's joined with the block's.
        """
        if row.processors and _is_lazy(rnd.block):
            rnd.block = tuple(rnd.block.tolist())  # processors read the block's history
        if on is not None:
            inputs = (
                rnd.block.astype(mx.int32) if _is_lazy(rnd.block) else mx.array(list(rnd.block))
            )
        elif rnd.chosen is None:
            inputs = mx.array(row.history[-1:])
        elif _is_lazy(rnd.block):
            inputs = mx.concatenate([mx.array(row.history[-1:]), rnd.block.astype(mx.int32)])
        else:
            inputs = mx.array([row.history[-1], *rnd.block])
        rnd.n_fed = int(inputs.shape[0]) + (0 if on is None else 1)
        self._choose_acceptor(row, rnd)
        # An extended round's verify time counts from the queued forward's launch.
        rnd.t_launch = time.perf_counter() if on is None else on.t_launch
        rnd.txn = plan.begin() if on is None else on.txn
        try:
            vr = self._verify(inputs, row.caches)
            if row.sync is not None:
                self.ranks.built(row.sync, vr.logits)
            rnd.vr = vr if on is None else _joined(on.vr, vr)
            project_row = vr.extras.get("project_row") if on is None else None
            if (
                project_row is not None
                and rnd.chosen is not None
                and rnd.acceptor == "greedy"
                and row.sampler.is_greedy
                and not row.processors
                and row.sync is None
            ):
                # The verifier projects rows on demand: queue the backbone only, and
                # project each position's logits until the first rejection.
                rnd.rows = project_row
                rnd.logits = rnd.vr.logits  # left unevaluated
                self._launch(row, rnd.vr.hidden)
            else:
                rnd.logits = self._process(rnd.vr.logits, row.history, rnd.block, row.processors)
                self._launch(row, rnd.logits)
        except BaseException:
            rnd.txn.abort()
            raise

    def _choose_acceptor(self, row: _Row, rnd: _Round) -> None:
        if self.policy.acceptor == AUTO:
            rnd.acceptor = auto_acceptor(row.sampler, rnd.q is not None)
        else:
            rnd.acceptor = self.policy.acceptor

    def _start_lookahead(self, row: _Row, plan: RollbackPlan, rnd: _Round) -> _Round:
        """Queue the next round as a plain step on ``rnd``'s lazily sampled token, before
        that token is read back (``rnd`` drafted nothing: its transaction keeps all).

        The next round adopts it when the token it was fed is the one ``rnd`` commits:
        as it is when no drafter proposes, else with the block fed on top of it (see
        :meth:`_adopt`); otherwise it is aborted (its cache writes undone) and a normal
        round runs: the output never depends on it.
        """
        try:
            rnd.txn.commit(rnd.n_fed, rnd.n_fed)  # nothing drafted: keep the fed token
        except BaseException:
            rnd.txn.abort()
            raise
        rnd.committed = True
        y = row.sampler.sample_lazy(rnd.logits[-1:], rnd.position)
        rnd.lazy_sample = y
        # Evaluated on its own, as plain decoding does: reading the token back then does
        # not wait for the whole lookahead forward, whose tail overlaps the host's work.
        self._launch(row, y)
        la = _Round(position=rnd.position + 1, fed_token=y)
        la.acceptor = rnd.acceptor
        la.t_launch = time.perf_counter()
        la.txn = plan.begin()
        try:
            la.vr = self._verify(y.astype(mx.int32), row.caches)
            la.logits = la.vr.logits
            self._launch(row, la.logits)
        except BaseException:
            la.txn.abort()
            raise
        return la

    def _adopt(self, row: _Row, plan: RollbackPlan, la: _Round) -> _Round:
        """The round after a lookahead: the lookahead itself when nobody drafts, else a
        round that feeds only the drafted block on top of it (the lookahead's forward
        already holds the last token and the logits that judge the first draft), in the
        lookahead's own transaction; the lookahead is aborted only when its position is
        not the round's or its result cannot be joined (verifier extras)."""
        rnd = _Round(position=len(row.history))
        try:
            self._plan(row, rnd)
        except BaseException:
            self._undo_lookahead(row, la)
            raise
        if la.position == rnd.position:
            if rnd.chosen is None:
                la.shadows = rnd.shadows
                row.stats.lookahead_rounds += 1
                return la
            if not set(la.vr.extras) - {"project_row"}:  # nothing that cannot be joined
                self._launch_round(row, plan, rnd, on=la)
                row.stats.lookahead_extended += 1
                return rnd
        self._undo_lookahead(row, la)
        self._launch_round(row, plan, rnd)
        return rnd

    @staticmethod
    def _undo_lookahead(row: _Row, la: _Round) -> None:
        """Abort a round queued ahead: its cache writes are undone, its forward discarded."""
        la.txn.abort()
        row.stats.lookahead_aborts += 1

    @staticmethod
    def _shadow(row: _Row, rnd: _Round, name: str, shadow: Callable, limit: int) -> None:
        """Ask a session the governor refused what it would have proposed (shadow scoring)."""
        t0 = time.perf_counter()
        draft = shadow(row.history, limit)
        if draft is not None and draft.size:
            toks = draft.tokens
            rnd.shadows[name] = tuple(toks.tolist()) if _is_lazy(toks) else tuple(toks)
            row.stats.shadow_proposals += 1
        row.stats.shadow_time_s += time.perf_counter() - t0

    @staticmethod
    def _launch(row: _Row, out: mx.array) -> None:
        """Queue the verify forward. The time is waiting time too: MLX lets only a few
        tasks be in flight, so on the CPU ``async_eval`` of a whole forward returns only
        when most of it has run."""
        t0 = time.perf_counter()
        mx.async_eval(out)
        row.stats.wait_time_s += time.perf_counter() - t0

    def _finish_round(self, row: _Row, rnd: _Round) -> RoundResult:
        """Read the round back (the one host sync), accept, commit the caches."""
        stats = row.stats
        if rnd.lazy_token is not None:  # a plain step
            t0 = time.perf_counter()
            tok = int(rnd.lazy_token.item())
            stats.wait_time_s += time.perf_counter() - t0
            return RoundResult(
                drafter=None,
                block=(),
                n_accepted=0,
                token=tok,
                committed=(tok,),
                verify=None,
                start_position=rnd.position,
            )
        if rnd.lazy_sample is not None and not rnd.block and rnd.acceptor in _PLAIN_WHEN_EMPTY:
            # Nothing drafted: these acceptors draw the plain sample of the position, which
            # the lookahead already drew (lazily, with the same key): read it back.
            t0 = time.perf_counter()
            tok = int(rnd.lazy_sample.item())
            stats.wait_time_s += time.perf_counter() - t0
            stats.acceptors[rnd.acceptor] = stats.acceptors.get(rnd.acceptor, 0) + 1
            return RoundResult(
                drafter=None,
                block=(),
                n_accepted=0,
                token=tok,
                committed=(tok,),
                verify=rnd.vr,
                start_position=rnd.position,
                shadows=rnd.shadows,
            )
        acceptor = self._acceptors[rnd.acceptor]
        try:
            t0 = time.perf_counter()
            if _is_lazy(rnd.block):
                rnd.block = tuple(rnd.block.tolist())
                if rnd.chosen is not None:
                    rnd.proposals[rnd.chosen] = rnd.block
            positions = range(rnd.position, rnd.position + rnd.n_fed)
            if rnd.rows is not None:
                acc = self._accept_rows(row, rnd)
            else:
                acc = acceptor.accept(rnd.block, rnd.q, rnd.logits, row.sampler, positions)
            t_commit = time.perf_counter()
            stats.wait_time_s += t_commit - t0
            n_acc = int(acc.n_accepted)
            if not 0 <= n_acc <= len(rnd.block):
                raise RuntimeError(
                    f"acceptor {rnd.acceptor!r} accepted {n_acc} of a {len(rnd.block)}-token block"
                )
            # Lazy: the next forward evaluates what the rollback built (no second sync).
            if not rnd.committed:
                rnd.txn.commit(rnd.n_fed, n_acc + 1)
        except BaseException:
            if not rnd.committed:
                rnd.txn.abort()
            raise
        t_done = time.perf_counter()
        if rnd.block:  # a round with nothing drafted has nothing to roll back
            stats.verify_time_s += t_commit - rnd.t_launch
            stats.commit_time_s += t_done - t_commit
        return self._result(row, rnd, n_acc, int(acc.token))

    @staticmethod
    def _accept_rows(row: _Row, rnd: _Round) -> Acceptance:
        """Greedy acceptance projecting the target's logits one position at a time, until
        the first position whose argmax is not the drafted token (the positions after it
        are never projected)."""
        block = rnd.block
        i = 0
        while True:
            tok = int(mx.argmax(rnd.rows(i), axis=-1).item())
            if i == len(block) or tok != block[i]:
                break
            i += 1
        rp = row.stats.row_projection
        rp["rounds"] = rp.get("rounds", 0) + 1
        rp["rows"] = rp.get("rows", 0) + i + 1
        rp["skipped"] = rp.get("skipped", 0) + len(block) - i
        return Acceptance(n_accepted=i, token=tok)

    @staticmethod
    def _result(row: _Row, rnd: _Round, n_acc: int, token: int) -> RoundResult:
        """Count an accepted round in the stats and describe it to the sessions."""
        stats, block = row.stats, rnd.block
        if row.sessions:  # plain decoding (a plain row of a batch) counts no acceptor
            stats.acceptors[rnd.acceptor] = stats.acceptors.get(rnd.acceptor, 0) + 1
        if rnd.chosen is not None:
            stats.drafted += len(block)
            stats.accepted += n_acc
            stats.rounds_with_draft += 1
            pd = stats.per_drafter[rnd.chosen]
            pd["rounds"] += 1
            pd["drafted"] += len(block)
            pd["accepted"] += n_acc
        return RoundResult(
            drafter=rnd.chosen,
            block=tuple(block),
            n_accepted=n_acc,
            token=token,
            committed=(*block[:n_acc], token),
            verify=rnd.vr,
            start_position=rnd.position,
            proposals={
                k: tuple(v.tolist()) if _is_lazy(v) else v for k, v in rnd.proposals.items()
            },
            shadows=rnd.shadows,
        )

    def _emit(
        self, row: _Row, new: list, n_acc: int, pos: int, detok: Any, t_start: float
    ) -> Iterator[StreamResponse]:
        """Yield the committed tokens ``new`` (the first ``n_acc`` were drafts); return True when the stream ended."""
        stats = row.stats
        for i, tok in enumerate(new):
            finish = None
            if tok in row.stop_ids:
                finish = "stop"
                detok.finalize()
                seg = detok.last_segment
                yield from self._finish(
                    row, seg, tok, i < n_acc, finish, t_start, pos + i, is_stop_token=True
                )
                return True
            detok.add_token(tok)
            seg = detok.last_segment
            row.n_out += 1
            if row.stop_strings:
                # Text that could begin a stop string is held back until it cannot.
                buf = row.pending + seg
                hits = [buf.find(s) for s in row.stop_strings if s in buf]
                if hits:
                    yield from self._finish(
                        row, buf[: min(hits)], tok, i < n_acc, "stop", t_start, pos + i
                    )
                    return True
                hold = max(len(s) for s in row.stop_strings) - 1
                cut = max(0, len(buf) - hold)
                seg, row.pending = buf[:cut], buf[cut:]
            if row.n_out >= row.max_tokens:
                detok.finalize()
                seg += detok.last_segment
                if row.stop_strings:
                    tail = row.pending + detok.last_segment
                    hits = [tail.find(s) for s in row.stop_strings if s in tail]
                    seg = seg[: len(seg) - len(detok.last_segment)] + (
                        tail[: min(hits)] if hits else tail
                    )
                    row.pending = ""
                reason = "stop" if row.stop_strings and hits else "length"
                yield from self._finish(row, seg, tok, i < n_acc, reason, t_start, pos + i)
                return True
            row.text += seg
            t_away = time.perf_counter()
            yield StreamResponse(
                text=seg, token=tok, from_draft=i < n_acc, position=pos + i, stats=stats
            )
            row.away_s += time.perf_counter() - t_away  # the consumer's time, not ours

        return False

    def _finish(
        self,
        row: _Row,
        seg: str,
        tok: int,
        from_draft: bool,
        reason: str,
        t_start: float,
        position: int,
        is_stop_token: bool = False,
    ):
        stats = row.stats
        stats.decode_time_s = time.perf_counter() - t_start
        stats.generation_tokens = row.n_out
        stats.finish_reason = reason
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        if row.sync is not None:
            # the synchronisation at the end of the request counts too
            stats.distributed = self.ranks.stats(
                row.sync, row.prefill_forwards, row.n_out, final_sync=True
            )
        if row.governor is not None:
            stats.governor = dict(row.governor.stats())
        if row.cost is not None:
            stats.verify_cost = row.cost.stats()  # with the round overhead learnt
        shown: dict[str, Any] = {}  # key -> head object
        for drafter, head in self.heads.items():
            extra = getattr(head, "stats", None)
            if not callable(extra):
                continue
            key = head.name
            if shown.get(key, head) is not head:  # another head of that name (another model)
                key = f"{head.name} ({drafter})"
            if key not in shown:
                shown[key] = head
                stats.draft_heads[key] = dict(extra())
        for name, s in row.sessions:
            extra = getattr(s, "stats", None)
            if callable(extra) and name in stats.per_drafter:
                stats.per_drafter[name].update(extra())
        row.text += seg
        yield StreamResponse(
            text=seg,
            token=tok,
            from_draft=from_draft,
            position=position,
            finish_reason=reason,
            stats=stats,
            is_stop_token=is_stop_token,
        )

    @staticmethod
    def _process(
        logits: mx.array, history: list, block: Sequence[int], processors: list
    ) -> mx.array:
        if not processors:
            return logits
        hist = mx.array(history)
        rows = []
        for i in range(logits.shape[0]):
            h = hist if i == 0 else mx.concatenate([hist, mx.array(list(block[:i]))])
            r = logits[i : i + 1]
            for p in processors:
                r = p(h, r)
            rows.append(r)
        return mx.concatenate(rows, axis=0).astype(mx.float32)


def assemble(
    model_or_path: Any = None,
    tokenizer: Any = None,
    policy: Policy | str | os.PathLike | dict | None = DEFAULT_POLICY,
    *,
    draft_model: Any = None,
    host: PluginHost | None = None,
    distributed: bool | None = None,
    sharding: str = "auto",
) -> Pipeline:
    """Build a :class:`Pipeline` from a model (or path / Hub id) and a policy.

    Args:
        model_or_path: an mlx-lm model, a model folder, a Hub id, or ``None`` for
            the built-in default model.
        tokenizer: the tokenizer when ``model_or_path`` is a model object (optional:
            without one, prompts must be token ids).
        policy: a :class:`Policy`, preset name, TOML path or dict; by default
            ``"default"`` (:func:`specdec.default_policy`: the ``copy`` preset when
            specdec-plugin-ngram and specdec-plugin-copy-governor are installed, else
            ``none``). ``"none"`` (or ``None``) is plain decoding.
        draft_model: shorthand: adds the ``draft_model`` drafter with this model (path or
            object) to ``policy``; with ``policy`` left at ``"default"`` it drafts alone.
        host: a plugin host (default: the process-wide one).
        distributed: shard the model across the ranks of a distributed job (this process
            started by ``mlx.launch`` or ``mpirun`` as one of several ranks; see
            :mod:`specdec.distributed`). ``None`` (default): a model loaded from a path is
            sharded when the process is one of several ranks, and a model object is used
            as it is (already sharded, e.g. by mlx-lm's ``sharded_load``: its ranks are
            kept in step; else a whole model on every rank, decoding independently).
            ``True``: shard a model object too, in place, and fail when this process is
            not one of several ranks. ``False``: never shard.
        sharding: how to shard (see :func:`specdec.distributed.shard_model`):
            ``"auto"`` (tensor parallel where the model allows it, else pipeline
            parallel, as mlx-lm's ``sharded_load``), ``"tensor"`` or ``"pipeline"``.

    Raises:
        PolicyError / UnknownComponentError: bad policy or component names (before loading the model).
        ModelLoadError: the model cannot be loaded, or cannot be split across the ranks.
        DistributedError: ``distributed=True`` in a process that is not one of several ranks.
    """
    h = host or get_plugin_host()
    pol = load_policy(policy, host=h, draft_model=draft_model is not None)
    if draft_model is not None:
        if "draft_model" not in pol.drafters:
            pol = attrs.evolve(pol, drafters=(*pol.drafters, "draft_model"))
        pol = pol.with_options("draft_model", model=draft_model)
    for n in pol.drafters:
        # Checks that need no model: capabilities and a named draft head.
        check_needs(h, pol, n)
        head = pol.options_for(n).get("head")
        if isinstance(head, str):
            try:
                h.get("draft_head", head)
            except UnknownComponentError as exc:
                raise PolicyError(f"drafter {n!r}: option head: {exc}") from exc
    if pol.governor:
        h.get("governor", pol.governor)
    h.get("verifier", pol.verifier)
    if pol.max_batch > 1:
        check_batch(h, pol)
    if pol.acceptor != AUTO:
        h.get("acceptor", pol.acceptor)
    if pol.rollback != AUTO:
        h.get("cache_rollback", pol.rollback)
    if sharding not in SHARDING_KINDS:
        raise PolicyError(f"sharding must be one of {', '.join(SHARDING_KINDS)}, got {sharding!r}")
    world = None if distributed is False else launched_world()
    if sharding != "auto" and world is None:
        raise DistributedError(
            f"sharding={sharding!r} splits a model across the ranks of a distributed job, "
            "but this process is not one of several ranks (or distributed=False): start it "
            "with mlx.launch, or leave sharding='auto'"
        )
    if distributed and world is None:
        raise DistributedError(
            "distributed=True, but this process is not one of several ranks: start it with "
            "mlx.launch (e.g. mlx.launch --backend ring -n 2 --hosts 127.0.0.1 script.py) "
            "or mpirun"
        )
    if model_or_path is None or isinstance(model_or_path, (str, os.PathLike)):
        from .loading import check_model_path, load_model

        if model_or_path is None:
            try:
                from .models.default import default_model_path
            except (
                ImportError
            ) as exc:  # pragma: no cover - the default model module ships with the core
                raise ModelLoadError(f"no default model available: {exc}") from exc
            model_or_path = default_model_path()
        check_model_path(model_or_path)
        # Sharded: loaded lazily, so each rank materialises only its shard's weights.
        model, tok = load_model(model_or_path, lazy=world is not None)
        tokenizer = tokenizer or tok
        if world is not None:
            shard_model(model, world, sharding)
    else:
        model = model_or_path
        # A model sharded elsewhere is adopted by Pipeline itself.
        if distributed and model_sharding(model) is None and not looks_sharded(model):
            shard_model(model, world, sharding)
    return Pipeline(model, tokenizer, pol, host=h)
