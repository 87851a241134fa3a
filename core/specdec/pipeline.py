"""The facade: :func:`assemble` and :class:`Pipeline`.

:func:`assemble` resolves a :class:`~specdec.policy.Policy` against the installed
plugins once and returns a :class:`Pipeline`, which holds the target and the
components. Each :meth:`Pipeline.stream` call is one request, run by the
single-request driver (:mod:`specdec.single`); :meth:`Pipeline.batch` hands rows
to the batch driver (:mod:`specdec.batch`). Both call the phases of
:mod:`specdec.round`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .composition import check_needs
from .coordinate import Coordinator, Solo
from .costs import CostModel
from .emit import GenerationResult, StreamResponse
from .errors import ModelLoadError, PolicyError, RequestError, UnknownComponentError
from .grammar import GrammarState, grammar_tokenizer
from .heads import model_vocab_size
from .lifecycle import RequestState, new_state
from .plugins import PluginHost, get_plugin_host
from .policy import AUTO, Policy
from .request import Request, prompt_ids
from .roles import RoundResult, missing, optional
from .sampling import validate_request
from .single import SingleDriver

__all__ = [
    "GenerationResult",
    "Pipeline",
    "StreamResponse",
    "validate_request",
]


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
        self.drafters = self._make_drafters()
        #: the target's vocabulary size: every drafted id is checked to be below it.
        self.vocab_size = self._vocab_size()
        self.governor = self._make_governor()
        self.verifier = self._make_verifier()
        #: how the model is split across the ranks of a distributed job (``None``: it is not).
        self.sharding = self._find_sharding()
        #: the ranks' synchronisation when the model is sharded (each request's
        #: coordinator uses it).
        self.ranks: Any = None
        if self.sharding is not None:
            from .distributed import RankSync

            self.ranks = RankSync(self.sharding, policy.max_block, self.drafters)
        #: Whether idle rounds may be queued ahead: no drafter reads the caches in
        #: propose (see :class:`specdec.single.SingleDriver`).
        self.lookahead = not any("kv" in optional(d, "drafter", "needs") for d in self.drafters)
        #: draft heads by drafter name (shared: built once per (model, head, options)).
        self.heads: dict[str, Any] = {}
        for d in self.drafters:
            head_name = optional(d, "drafter", "head")
            if head_name:
                self.heads[d.name] = self._head(d, head_name)
        #: the acceptors by name: the policy's, or for ``auto`` the three built-in ones.
        self.acceptors: dict[str, Any] = {}
        if policy.acceptor != AUTO:
            self.acceptors[policy.acceptor] = self.host.create(
                "acceptor", policy.acceptor, policy.options_for(policy.acceptor)
            )
        else:
            for n in ("greedy", "point_mass", "rejection"):
                self.acceptors[n] = self.host.create("acceptor", n)
        if policy.rollback != AUTO:
            self.host.get("cache_rollback", policy.rollback)
        for d in self.drafters:
            attach = optional(d, "drafter", "attach")
            if attach is not None:
                attach(model, tokenizer)
        # the decoder layers the drafters read, after attach (a drafter may learn them there)
        layers = [i for d in self.drafters for i in optional(d, "drafter", "hidden_layers")]
        bind = optional(self.verifier, "verifier", "bind")
        if bind is not None:
            bind(model, layers=tuple(layers))
        elif layers:
            raise PolicyError(
                f"drafters ask for decoder layers {layers} but verifier {policy.verifier!r} "
                "cannot be told which layers to capture (it has no bind(model, layers=...))"
            )
        #: the verify cost curve of this model on this device, when a drafter reads it.
        self.cost_model: CostModel | None = None
        if self.ranks is None and any(
            optional(d, "drafter", "uses_verify_cost") for d in self.drafters
        ):
            # Profiled with the built-in logits verifier: the cost of the model's own
            # forward, whatever verifier the policy names (a plugin's verifier may keep
            # state that profiling forwards must not touch).
            self.cost_model = CostModel(model, None, host=self.host)

    def _make_drafters(self) -> list:
        h, policy = self.host, self.policy
        drafters = [h.create("drafter", n, policy.options_for(n)) for n in policy.drafters]
        for d in drafters:
            gaps = missing(d, "drafter")
            if "name" in gaps:
                raise PolicyError(f"drafter {d!r} has no name attribute")
            if "session" in gaps:
                info = h.get("drafter", d.name)
                raise PolicyError(
                    f"drafter {d.name!r} ({info.distribution} {info.version}) has no "
                    "session(ctx) method: specdec-core 0.2 keeps per-request state in a "
                    "session the drafter makes per request (see docs/writing-plugins.md)"
                )
            check_needs(h, policy, d.name, optional(d, "drafter", "needs"))
        return drafters

    def _vocab_size(self) -> int:
        v = model_vocab_size(self.model)
        if v is None and self.drafters:
            raise PolicyError(
                f"cannot tell the vocabulary size of {type(self.model).__name__} (no "
                "args.vocab_size, no model.embed_tokens), which drafts are checked against: "
                "give the model an args.vocab_size"
            )
        return v or 0

    def _make_governor(self) -> Any:
        policy = self.policy
        if not policy.governor:
            return None
        gov = self.host.create("governor", policy.governor, policy.options_for(policy.governor))
        if "session" in missing(gov, "governor"):
            raise PolicyError(
                f"governor {policy.governor!r} has no session(ctx) method: specdec-core 0.2 "
                "keeps per-request state in a session the governor makes per request"
            )
        return gov

    def _make_verifier(self) -> Any:
        policy = self.policy
        verifier = self.host.create(
            "verifier", policy.verifier, policy.options_for(policy.verifier)
        )
        if "logits" not in optional(verifier, "verifier", "provides"):
            raise PolicyError(f"verifier {policy.verifier!r} does not provide logits")
        return verifier

    def _find_sharding(self) -> Any:
        from . import distributed as dist  # not loaded by `import specdec`

        sharding = dist.model_sharding(self.model)
        if sharding is None and dist.looks_sharded(self.model):
            # sharded elsewhere (mlx-lm's sharded_load) and handed to Pipeline directly
            world = dist.launched_world()
            if world is None:
                raise PolicyError(
                    "the model is sharded (its forward issues collectives) but this process is "
                    "not one of several ranks: run it under mlx.launch"
                )
            sharding = dist.adopt_sharding(self.model, world)
        return sharding

    def prepare(
        self,
        progress: Callable[[int, int, str], None] | None = None,
        *,
        context: int | None = None,
        rows: int | None = None,
    ) -> None:
        """Do the one-off work before the first request: load the verify cost curve, or
        profile it (seconds, once per model and device; ``progress(done, total, label)``
        is told how far it got). Requests call it themselves when it was not called.

        ``context``: the longest context requests are expected to reach. The curve is
        profiled that far now (once per machine, cached) where it has not been
        measured to half of it, instead of inside the first request that gets there
        (a server should not keep one request's first token waiting for it).

        ``rows``: the most rows batches will have (:meth:`batch`). The curves of batches
        of 2, 4, ... rows up to the power of two at or above it are loaded or profiled
        now, instead of in the first round of a batch that size (they size the blocks
        of a batch's rows, :func:`specdec.costs.best_width`).
        """
        if context is not None and (
            isinstance(context, bool) or not isinstance(context, int) or context < 1
        ):
            raise RequestError(f"context must be an integer >= 1, got {context!r}")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise RequestError(f"rows must be an integer >= 1, got {rows!r}")
        if self.cost_model is None:
            return
        if progress is not None:
            self.cost_model.progress = progress
        if not self.cost_model.loaded:
            self.cost_model.curve()
        if context is not None:
            self.cost_model.note_context(context)
            self.cost_model.refresh()
        n = 2
        while rows is not None and self.policy.batch_sizing == "width" and n < 2 * rows:
            self.cost_model.batch_curve(n)
            n *= 2

    def _head(self, d: Any, name: str) -> Any:
        drafter = d.name
        try:
            self.host.get("draft_head", name)
        except UnknownComponentError as exc:
            raise PolicyError(f"drafter {drafter!r}: option head: {exc}") from exc
        # A drafter with a model of its own (a draft model) names it as head_model: the
        # head reads that model's output layer; else the target's.
        model = optional(d, "drafter", "head_model")
        own = model is not None
        if not own:
            model = self.model
        # A drafter's own model shares the target's vocabulary (checked in attach), so
        # the pipeline's tokenizer stands in when the drafter has none of its own.
        tokenizer = (optional(d, "drafter", "head_tokenizer") if own else None) or self.tokenizer
        head = self.host.draft_head(name, self.policy.options_for(name), model, tokenizer)
        tv, hv = model_vocab_size(self.model), optional(head, "draft_head", "vocab_size")
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

    def encode_messages(
        self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None
    ) -> list[int]:
        """Prompt ids of chat ``messages`` (``{"role", "content"}`` dicts) through the
        tokenizer's chat template, with the generation prompt added; ``tools``
        (OpenAI-style function definitions) are given to the template as its
        ``tools`` variable.

        Raises:
            RequestError: no tokenizer, or a tokenizer without a chat template.
            Exception: whatever the template raises for messages it refuses (jinja's
                ``TemplateError``, for example).
        """
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "this pipeline's tokenizer has no chat template: pass a plain prompt instead"
            )
        extra = {} if tools is None else {"tools": list(tools)}
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **extra
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    # -- requests -------------------------------------------------------------------

    def request_state(
        self,
        prompt: str | Sequence[int],
        request: Request | None = None,
        kwargs: dict | None = None,
        prompt_cache: list | None = None,
    ) -> RequestState:
        """A request's decode state: its arguments checked (a :class:`specdec.Request`,
        or built from ``kwargs``) against this pipeline's policy, its prompt tokenized,
        fresh caches or ``prompt_cache`` (checked); no session yet. Used by the drivers;
        everything fails here, before any model work.

        Raises:
            RequestError: a bad argument.
            TypeError: an argument no request has.
        """
        if request is None:
            request = Request.of(kwargs or {})
        elif kwargs:
            raise TypeError(
                f"give the request's arguments either as a Request or as keywords, not both "
                f"(got request= and {sorted(kwargs)})"
            )
        self._check_policy(request)
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size or None)
        if prompt_cache is not None and self.ranks is not None:
            raise RequestError(
                "prompt_cache is not available on a model sharded across ranks (each rank "
                "holds its own shard of the caches)"
            )
        return new_state(self, request, ids, prompt_cache)

    def _check_policy(self, request: Request) -> None:
        if self.policy.acceptor == "greedy" and request.temperature > 0:
            raise RequestError(
                f"policy {self.policy.name!r} names acceptor 'greedy', which is only exact with "
                f"temperature 0 (got temperature={request.temperature}); use acceptor 'auto', "
                "'point_mass' or 'rejection' for sampling"
            )

    def grammar_tokenizer(self) -> Any:
        """llguidance's tokenizer for this pipeline's tokenizer and vocabulary, built on
        the first constrained request (a few hundred ms) and kept for every pipeline of
        that tokenizer (:func:`specdec.grammar.grammar_tokenizer`).

        Raises:
            RequestError: the pipeline has no tokenizer llguidance can read.
        """
        return grammar_tokenizer(self.tokenizer, self.vocab_size)

    def grammar_state(self, request: Request) -> GrammarState | None:
        """A fresh matcher for ``request``'s grammar (``None`` without one).

        Raises:
            RequestError: the grammar does not compile for this tokenizer, cannot be
                rolled back, or the model is sharded across ranks.
        """
        if request.grammar is None:
            return None
        if self.ranks is not None:
            raise RequestError(
                "grammar is not available on a model sharded across ranks yet (the ranks "
                "would each need the matcher); run constrained requests on one process"
            )
        return GrammarState(
            self.grammar_tokenizer(), request.grammar, request.stop_ids(self.tokenizer)
        )

    def check_request(self, **kwargs: Any) -> Request:
        """Check a request's arguments as :meth:`stream` does before any model work, for
        callers that must refuse a request before queueing it (a server). Arguments no
        request has (the prompt, ...) are ignored.

        Returns:
            the :class:`specdec.Request` the arguments make.

        Raises:
            RequestError: naming the bad argument and what is accepted.
        """
        request = Request.of(kwargs, ignore_unknown=True)
        self._check_policy(request)
        self.grammar_state(request)  # compiles for this tokenizer, or refuses
        return request

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
        assert last is not None and last.stats is not None
        return GenerationResult(
            text="".join(text), tokens=tokens, stats=last.stats, finish_reason=last.finish_reason
        )

    def batch(self, max_rows: int | None = None) -> Any:
        """A :class:`specdec.Batch` of up to ``max_rows`` rows (default: the policy's
        ``max_batch``) for continuous batching: ``add`` requests, ``step`` rounds.

        Raises:
            PolicyError: a component of the policy cannot run rows of a batch.
        """
        from .batch import Batch  # the batch driver builds on the facade: imported late

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
        request: Request | None = None,
        *,
        prompt_cache: list | None = None,
        on_round: Callable[[RoundResult, list], None] | None = None,
        **kwargs: Any,
    ) -> Iterator[StreamResponse]:
        """Generate up to ``max_tokens`` tokens after ``prompt``, yielding each as it is committed.

        Args:
            prompt: text (tokenized without chat template; see :meth:`encode_prompt`) or token ids.
            request: the request's arguments as a :class:`specdec.Request`, or
            kwargs: the same as keywords: ``max_tokens`` (256), ``temperature`` (0),
                ``top_p``, ``top_k``, ``min_p``, ``min_tokens_to_keep``, ``seed``,
                ``stop``, ``stop_tokens``, ``logits_processors``, ``repetition_penalty``,
                ``repetition_context_size``, ``presence_penalty``, ``frequency_penalty``,
                ``logit_bias``, ``prefill_step_size`` (see :class:`specdec.Request`).
            prompt_cache: the model's per-layer caches
                (``mlx_lm.models.cache.make_prompt_cache(model)``) holding the prompt's
                first tokens, as mlx-lm's ``stream_generate`` takes one: only the rest of
                the prompt is prefilled, and the cache is used in place (after the
                request it holds the prompt and the output, so the next turn of a
                conversation, given as the whole conversation, prefills only what is
                new). Which tokens it holds is the caller's word: give a prompt that
                starts with them. Drafter sessions see ``ctx.cached`` and ``prefill``
                chunks from that position on (``ngram_copy`` and ``draft_model`` use the
                whole prompt; ``qwen_mtp`` starts its head cache there).
                ``stats.cached_tokens`` says how many tokens it held.
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
        state = self.request_state(prompt, request, kwargs, prompt_cache)
        return SingleDriver(self, state, self.coordinator(), on_round).run()

    def coordinator(self) -> Coordinator:
        """A fresh coordinator for one request: :class:`specdec.coordinate.Solo` in one
        process, a rank coordinator on a model sharded across ranks."""
        if self.ranks is None:
            return Solo()
        from .distributed import RankCoordinator

        return RankCoordinator(self.ranks, self.model)
