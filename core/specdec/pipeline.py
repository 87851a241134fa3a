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
from .errors import ModelLoadError, PolicyError, RequestError
from .plugins import PluginHost, get_plugin_host
from .policy import AUTO, Policy, load_policy
from .roles import RequestContext, RoundResult
from .rollback import RollbackPlan, build_plan
from .sampling import Sampler, validate_request
from .stats import Stats

__all__ = ["GenerationResult", "Pipeline", "StreamResponse", "assemble", "validate_request"]


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


def _vocab_size(model: Any) -> int | None:
    v = getattr(getattr(model, "args", None), "vocab_size", None)
    return int(v) if v is not None else None


class Pipeline:
    """A target model plus the components a policy names.

    Build it with :func:`assemble`. Components are created once here (so bad
    names and options fail before any model work) and reset per request.
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
            if "hidden" in getattr(d, "needs", ()) and policy.verifier == "logits":
                raise PolicyError(
                    f"drafter {d.name!r} needs the target's hidden states: set verifier = 'hidden' "
                    "(or another verifier that returns them) in the policy"
                )
            attach = getattr(d, "attach", None)
            if attach is not None:
                attach(model, tokenizer)
        self.governor = (
            h.create("governor", policy.governor, policy.options_for(policy.governor))
            if policy.governor
            else None
        )
        self.verifier = h.create("verifier", policy.verifier, policy.options_for(policy.verifier))
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
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return [int(t) for t in ids]
        return [int(t) for t in self.tokenizer.encode(text)]

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
        v = _vocab_size(self.model)
        if v is not None:
            bad = [t for t in ids if t < 0 or t >= v]
            if bad:
                raise RequestError(f"prompt token ids must be in [0, {v}); got {bad[:5]}")
        return ids

    # -- requests -------------------------------------------------------------------

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
            on_round: debug hook called after each round with ``(RoundResult, caches)``.

        Yields:
            :class:`StreamResponse` per committed token; the last has ``finish_reason`` and final ``stats``.

        Raises:
            RequestError: bad arguments, before any model work.
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
        )
        return self._run(row, prefill_step_size, on_round)

    def _run(
        self, row: _Row, prefill_step_size: int, on_round: Callable | None
    ) -> Iterator[StreamResponse]:
        policy, stats, caches = self.policy, row.stats, row.caches
        plan = build_plan(self.host, caches, model=self.model, policy=policy)
        stats.rollbacks = plan.names()
        drafters = list(self.drafters)
        if not drafters:
            stats.speculation_off_reason = f"policy {policy.name!r} has no drafters"
        elif not plan.ok:
            stats.speculation_off_reason = plan.reason
            drafters = []
        detok = getattr(self.tokenizer, "detokenizer", None) if self.tokenizer is not None else None
        if detok is None:
            detok = _NaiveDetokenizer(self.tokenizer)
        detok.reset()

        mx.reset_peak_memory()
        t0 = time.perf_counter()
        prompt = row.history
        for start in range(0, len(prompt) - 1, prefill_step_size):
            chunk = prompt[start : min(start + prefill_step_size, len(prompt) - 1)]
            self.model(mx.array(chunk)[None], cache=caches)
            mx.eval([c.state for c in caches])
        t1 = time.perf_counter()
        stats.prompt_time_s = t1 - t0

        ctx_common = dict(
            model=self.model,
            tokenizer=self.tokenizer,
            prompt_tokens=list(prompt),
            max_tokens=row.max_tokens,
            sampler=row.sampler,
            caches=caches,
            host=self.host,
        )
        begun: list = []
        try:
            for d in drafters:
                d.begin(RequestContext(**ctx_common, options=policy.options_for(d.name)))
                begun.append(d)
            if self.governor is not None and hasattr(self.governor, "begin"):
                self.governor.begin(
                    RequestContext(**ctx_common, options=policy.options_for(policy.governor))
                )
            for d in drafters:
                stats.per_drafter[d.name] = {"rounds": 0, "drafted": 0, "accepted": 0}
            if not drafters and on_round is None:
                yield from self._plain_rounds(row, detok)
            else:
                yield from self._rounds(row, drafters, plan, detok, on_round)
        finally:
            for d in begun:
                try:
                    d.end()
                except Exception:  # ending must not mask the real error
                    pass

    def _rounds(
        self, row: _Row, drafters: list, plan: RollbackPlan, detok: Any, on_round
    ) -> Iterator[StreamResponse]:
        policy, stats, caches, sampler = self.policy, row.stats, row.caches, row.sampler
        t_start = time.perf_counter()
        while True:
            remaining = row.max_tokens - row.n_out
            limit = min(policy.max_block, remaining - 1)
            block: tuple = ()
            q = None
            chosen = None
            if drafters and limit >= policy.min_block:
                for d in drafters:
                    budget = self.governor.budget(d.name, limit) if self.governor else limit
                    budget = min(budget, limit)
                    if budget < policy.min_block:
                        continue
                    draft = d.propose(row.history, budget)
                    if draft is None or len(draft.tokens) < policy.min_block:
                        continue
                    block = draft.tokens[:budget]
                    q = None if draft.probs is None else draft.probs[: len(block)]
                    chosen = d
                    break
            inputs = [row.history[-1], *block]
            positions = list(range(len(row.history), len(row.history) + len(inputs)))
            if policy.acceptor == AUTO:
                acc_name = auto_acceptor(sampler, q is not None)
            else:
                acc_name = policy.acceptor
                if acc_name == "greedy" and not sampler.is_greedy:
                    raise RequestError(
                        "acceptor 'greedy' is only exact with temperature 0; use acceptor 'auto', "
                        "'point_mass' or 'rejection' for sampling"
                    )
            acceptor = self._acceptors[acc_name]
            t_verify = time.perf_counter()
            txn = plan.begin()
            try:
                vr = self.verifier.verify(self.model, mx.array(inputs), caches)
                logits = self._process(vr.logits, row.history, block, row.processors)
                acc = acceptor.accept(block, q, logits, sampler, positions)  # reads logits back
                n_acc = int(acc.n_accepted)
                if not 0 <= n_acc <= len(block):
                    raise RuntimeError(
                        f"acceptor {acc_name!r} accepted {n_acc} of a {len(block)}-token block"
                    )
                t_commit = time.perf_counter()
                txn.commit(len(inputs), n_acc + 1)
                mx.eval([c.state for c in caches])
            except BaseException:
                txn.abort()
                raise
            t_done = time.perf_counter()
            if block:  # a round with nothing drafted has nothing to roll back
                stats.verify_time_s += t_commit - t_verify
                stats.commit_time_s += t_done - t_commit
            stats.target_forwards += 1
            stats.acceptors[acc_name] = stats.acceptors.get(acc_name, 0) + 1
            if chosen is not None:
                stats.drafted += len(block)
                stats.accepted += n_acc
                stats.rounds_with_draft += 1
                pd = stats.per_drafter[chosen.name]
                pd["rounds"] += 1
                pd["drafted"] += len(block)
                pd["accepted"] += n_acc
                if self.governor is not None:
                    self.governor.observe(chosen.name, len(block), n_acc)
            new = [*block[:n_acc], int(acc.token)]
            result = RoundResult(
                drafter=chosen.name if chosen else None,
                block=tuple(block),
                n_accepted=n_acc,
                token=int(acc.token),
                committed=tuple(new),
                verify=vr,
                start_position=len(row.history),
            )
            pos = len(row.history)
            row.history.extend(new)
            for d in drafters:
                d.observe(result)
            if self.governor is not None and hasattr(self.governor, "observe_round"):
                self.governor.observe_round(result)
            if on_round is not None:
                on_round(result, caches)
            if (yield from self._emit(row, new, n_acc, pos, detok, t_start)):
                return

    def _plain_rounds(self, row: _Row, detok: Any) -> Iterator[StreamResponse]:
        """Plain decoding, pipelined like mlx-lm: the next forward is queued before the
        current token is read back, so graph building overlaps computation."""
        stats, caches, sampler = row.stats, row.caches, row.sampler
        t_start = time.perf_counter()
        hist = mx.array(row.history) if row.processors else None

        def step(tok: mx.array, position: int) -> mx.array:
            logits = self.verifier.verify(self.model, tok, caches).logits
            if row.processors:
                for p in row.processors:
                    logits = p(hist, logits)
            return sampler.sample_lazy(logits, position)

        y = step(mx.array(row.history[-1:]), len(row.history))
        mx.async_eval(y)
        while True:
            pos = len(row.history)
            nxt = None
            if row.n_out + 1 < row.max_tokens:
                if row.processors:
                    hist = mx.concatenate([hist, y])
                nxt = step(y, pos + 1)
                mx.async_eval(nxt)
            tok = int(y.item())
            stats.target_forwards += 1
            row.history.append(tok)
            if (yield from self._emit(row, [tok], 0, pos, detok, t_start)):
                return
            y = nxt

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
            yield StreamResponse(
                text=seg, token=tok, from_draft=i < n_acc, position=pos + i, stats=stats
            )

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
        if self.governor is not None:
            stats.governor = dict(self.governor.stats())
        for d in self.drafters:
            extra = getattr(d, "stats", None)
            if callable(extra) and d.name in stats.per_drafter:
                stats.per_drafter[d.name].update(extra())
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
    policy: Policy | str | os.PathLike | dict | None = "none",
    *,
    draft_model: Any = None,
    host: PluginHost | None = None,
) -> Pipeline:
    """Build a :class:`Pipeline` from a model (or path / Hub id) and a policy.

    Args:
        model_or_path: an mlx-lm model, a model folder, a Hub id, or ``None`` for
            the built-in default model.
        tokenizer: the tokenizer when ``model_or_path`` is a model object (optional:
            without one, prompts must be token ids).
        policy: a :class:`Policy`, preset name, TOML path or dict.
        draft_model: shorthand: adds the ``draft_model`` drafter with this model (path or object).
        host: a plugin host (default: the process-wide one).

    Raises:
        PolicyError / UnknownComponentError: bad policy or component names (before loading the model).
        ModelLoadError: the model cannot be loaded.
    """
    pol = load_policy(policy)
    if draft_model is not None:
        if "draft_model" not in pol.drafters:
            pol = attrs.evolve(pol, drafters=(*pol.drafters, "draft_model"))
        pol = pol.with_options("draft_model", model=draft_model)
    h = host or get_plugin_host()
    for n in pol.drafters:
        h.get("drafter", n)
    if pol.governor:
        h.get("governor", pol.governor)
    h.get("verifier", pol.verifier)
    if pol.acceptor != AUTO:
        h.get("acceptor", pol.acceptor)
    if pol.rollback != AUTO:
        h.get("cache_rollback", pol.rollback)
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
        model, tok = load_model(model_or_path)
        tokenizer = tokenizer or tok
    else:
        model = model_or_path
    return Pipeline(model, tokenizer, pol, host=h)
