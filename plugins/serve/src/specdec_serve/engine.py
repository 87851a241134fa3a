"""The engine behind ``specdec serve``: one model, a pipeline per policy, a worker thread.

Requests are validated on the event loop (before any model work) and queued as
:class:`Job` objects. One worker thread decodes them with continuous batching:
each policy whose components support batched rows has a :class:`specdec.Batch`
of up to ``max_batch`` rows; between rounds new requests join it (their prompt
is prefilled, then their cache joins the batch's) and finished, failed or
cancelled ones leave it. A prompt that starts with the tokens an earlier request
held starts from a copy of that request's caches (:class:`PrefixCache`) and
prefills only the rest. Every round is one target forward for all the rows of
that policy's batch; batches of different policies take turns, a round each.
A policy that cannot run rows of a batch (a drafter without ``supports_batch``)
runs each request alone through ``Pipeline.stream``, a token per turn of the
worker, taking turns with the batches' rounds. Every committed token goes back
to the request's asyncio queue. A request whose client went away leaves its
batch at the next round. An exception inside a round fails only the requests it
concerns: a row's own (drafter, acceptor) fails that row, the caches of the
other rows stay as they were.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
from collections.abc import Sequence
from typing import Any

import specdec
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from .prefix import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, PrefixCache

log = logging.getLogger("specdec.serve")

#: Requests decoded together per policy, by default.
DEFAULT_MAX_BATCH = 8
#: The context the verify cost curve is profiled to at startup, by default: an agent's
#: conversation gets there in a few turns (capped at the model's context).
DEFAULT_PROFILE_CONTEXT = 4096


class Job:
    """One request's generation: its prompt ids, sampling, stop strings and the queue
    its tokens go to (``("token", StreamResponse)``, then ``("done", stats dict,
    finish_reason)`` or ``("error", exception)``)."""

    _ids = itertools.count(1)

    def __init__(
        self,
        policy: str,
        prompt_ids: list[int],
        params: dict,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.id = next(self._ids)
        self.policy = policy
        self.prompt_ids = prompt_ids
        self.params = params
        self.loop = loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        #: prompt tokens taken from the prefix cache (set by the worker)
        self.cached = 0
        #: token ids committed so far (the worker's, for the prefix cache)
        self.tokens: list[int] = []
        #: the caches of a request running alone (filled in place by its stream), and
        #: whether their entries are in position order (see specdec.CacheSnapshot)
        self.caches: list | None = None
        self.ordered = True

    def emit(self, item: tuple) -> None:
        """Hand ``item`` to the request's coroutine (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is going down
            self.cancelled.set()


class Metrics:
    """Counters and gauges for ``/metrics`` (Prometheus text format), thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.target_forwards = 0
        self.drafted: dict[str, int] = {}
        self.accepted: dict[str, int] = {}
        self.position_reached: dict[tuple[str, int], int] = {}
        self.position_accepted: dict[tuple[str, int], int] = {}
        self.decode_seconds = 0.0
        self.cancelled = 0
        self.failed = 0
        self.cached_tokens = 0
        self.prefix_errors = 0

    def request(self, endpoint: str, status: int) -> None:
        with self.lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def rounds(self, n: int, seconds: float) -> None:
        """Add ``n`` decoding rounds (target forwards) that took ``seconds`` in all."""
        with self.lock:
            self.target_forwards += n
            self.decode_seconds += seconds

    def finished(self, stats: dict, *, alone: bool = False) -> None:
        """Add one request's final stats (its rounds too when it ran ``alone``: a
        batch's rounds are added by :meth:`rounds`, once for all their rows)."""
        if alone:
            self.rounds(
                int(stats.get("target_forwards") or 0), float(stats.get("decode_time_s") or 0)
            )
        with self.lock:
            self.generated_tokens += int(stats.get("generation_tokens") or 0)
            self.prompt_tokens += int(stats.get("prompt_tokens") or 0)
            self.cached_tokens += int(stats.get("cached_tokens") or 0)
            for name, d in (stats.get("per_drafter") or {}).items():
                self.drafted[name] = self.drafted.get(name, 0) + int(d.get("drafted") or 0)
                self.accepted[name] = self.accepted.get(name, 0) + int(d.get("accepted") or 0)
                reached = d.get("position_reached") or []
                acc = d.get("position_accepted") or []
                for i, r in enumerate(reached):
                    k = (name, i + 1)
                    self.position_reached[k] = self.position_reached.get(k, 0) + int(r)
                    a = int(acc[i]) if i < len(acc) else 0
                    self.position_accepted[k] = self.position_accepted.get(k, 0) + a

    def render(self, queue_length: int, running: int, prefix: dict | None = None) -> str:
        """The Prometheus text exposition of every metric (``prefix``: the prefix
        cache's :meth:`PrefixCache.stats`, ``None`` when it is off)."""

        def esc(v: str) -> str:
            return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: Sequence[tuple[str, Any]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in samples:  # a summary's "_sum"/"_count" go on the name
                lines.append(f"{name}{labels} {value}")

        with self.lock:
            metric(
                "specdec_requests_total",
                "counter",
                "HTTP requests by endpoint and status code.",
                [
                    (f'{{endpoint="{esc(e)}",code="{c}"}}', n)
                    for (e, c), n in sorted(self.requests.items())
                ],
            )
            metric(
                "specdec_queue_length",
                "gauge",
                "Requests waiting for the worker.",
                [("", queue_length)],
            )
            metric(
                "specdec_running_requests",
                "gauge",
                "Requests being generated now.",
                [("", running)],
            )
            metric(
                "specdec_generated_tokens_total",
                "counter",
                "Tokens generated.",
                [("", self.generated_tokens)],
            )
            metric(
                "specdec_prompt_tokens_total",
                "counter",
                "Prompt tokens of finished requests (cached ones included).",
                [("", self.prompt_tokens)],
            )
            metric(
                "specdec_prompt_cached_tokens_total",
                "counter",
                "Prompt tokens of finished requests taken from the prefix cache (not prefilled).",
                [("", self.cached_tokens)],
            )
            if prefix is not None:
                metric(
                    "specdec_prefix_cache_entries",
                    "gauge",
                    "Request caches the prefix cache holds.",
                    [("", prefix["entries"])],
                )
                metric(
                    "specdec_prefix_cache_bytes",
                    "gauge",
                    "Bytes of keys and values the prefix cache holds.",
                    [("", prefix["bytes"])],
                )
                metric(
                    "specdec_prefix_cache_errors_total",
                    "counter",
                    "Prefix cache lookups and insertions that failed (logged; the requests "
                    "went on without them).",
                    [("", self.prefix_errors)],
                )
                metric(
                    "specdec_prefix_cache_lookups_total",
                    "counter",
                    "Requests that looked for a cached prefix, by whether one was found.",
                    [('{result="hit"}', prefix["hits"]), ('{result="miss"}', prefix["misses"])],
                )
            metric(
                "specdec_target_forwards_total",
                "counter",
                "Forward passes of the target model while decoding (one per round; a "
                "batch's round is one forward for all its rows).",
                [("", self.target_forwards)],
            )
            metric(
                "specdec_drafted_tokens_total",
                "counter",
                "Tokens proposed by each drafter.",
                [(f'{{drafter="{esc(k)}"}}', v) for k, v in sorted(self.drafted.items())],
            )
            metric(
                "specdec_accepted_tokens_total",
                "counter",
                "Drafted tokens the target accepted, by drafter.",
                [(f'{{drafter="{esc(k)}"}}', v) for k, v in sorted(self.accepted.items())],
            )
            metric(
                "specdec_position_reached_total",
                "counter",
                "Rounds whose block reached draft position N, by drafter (drafters that report it).",
                [
                    (f'{{drafter="{esc(k)}",position="{p}"}}', v)
                    for (k, p), v in sorted(self.position_reached.items())
                ],
            )
            metric(
                "specdec_position_accepted_total",
                "counter",
                "Rounds whose draft at position N was accepted, by drafter.",
                [
                    (f'{{drafter="{esc(k)}",position="{p}"}}', v)
                    for (k, p), v in sorted(self.position_accepted.items())
                ],
            )
            metric(
                "specdec_round_seconds",
                "summary",
                "Time of the decoding rounds (one target forward each): sum and count.",
                [("_sum", round(self.decode_seconds, 6)), ("_count", self.target_forwards)],
            )
            metric(
                "specdec_cancelled_requests_total",
                "counter",
                "Requests whose client went away.",
                [("", self.cancelled)],
            )
            metric(
                "specdec_failed_requests_total",
                "counter",
                "Requests that failed inside generation.",
                [("", self.failed)],
            )
        return "\n".join(lines) + "\n"


class Engine:
    """The served model, its pipelines (one per policy, built on first use) and the worker.

    Args:
        model: a model folder or Hub id (``None``: the built-in default model).
        policies: the policies this server offers, by preset name or TOML path; the
            first is the default of a request that names none. Requests may also name
            any preset.
        model_name: the id ``/v1/models`` lists and requests must name (default: the
            model folder's name).
        max_batch: requests decoded together per policy.
        prompt_cache_bytes: the prefix cache's bound on keys and values kept (0: no
            prefix cache).
        prompt_cache_size: the prefix cache's bound on entries.
        profile_context: the context the policies' verify cost curves are profiled to
            before serving (once per machine, cached; capped at the model's context),
            so that no request's first token waits for it (0: only the default
            contexts; a request that goes far past them then profiles first).
    """

    def __init__(
        self,
        model: str | None = None,
        policies: Sequence[str] = ("none",),
        *,
        model_name: str | None = None,
        max_batch: int = DEFAULT_MAX_BATCH,
        prompt_cache_bytes: int = DEFAULT_MAX_BYTES,
        prompt_cache_size: int = DEFAULT_MAX_ENTRIES,
        profile_context: int = DEFAULT_PROFILE_CONTEXT,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise specdec.PolicyError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        for name, v, low in (
            ("prompt_cache_bytes", prompt_cache_bytes, 0),
            ("prompt_cache_size", prompt_cache_size, 1),
            ("profile_context", profile_context, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise specdec.PolicyError(f"{name} must be an integer >= {low}, got {v!r}")
        self.max_batch = max_batch
        #: the prefix cache (``None``: off)
        self.prefix = (
            PrefixCache(prompt_cache_bytes, prompt_cache_size) if prompt_cache_bytes else None
        )
        if not policies:
            raise specdec.PolicyError("give at least one policy")
        self._pipes_lock = threading.Lock()
        self.policy_specs: dict[str, specdec.Policy] = {}
        for spec in policies:
            pol = specdec.load_policy(spec)
            if pol.name in self.policy_specs:
                raise specdec.PolicyError(
                    f"two policies are named {pol.name!r} ({spec!r} and an earlier one): "
                    "each policy a server offers needs its own name (name = ... in a TOML file)"
                )
            self.policy_specs[pol.name] = pol
        self.default_policy = specdec.load_policy(policies[0]).name
        first = self.policy_specs[self.default_policy]
        pipe = specdec.assemble(model, policy=first)
        self.model, self.tokenizer = pipe.model, pipe.tokenizer
        self.pipes: dict[str, Any] = {self.default_policy: pipe}
        args = getattr(self.model, "args", None)
        self.context_length = getattr(args, "max_position_embeddings", None)
        longest = profile_context or None
        if longest is not None and self.context_length:
            longest = min(longest, int(self.context_length))
        rows = max_batch if max_batch > 1 else None  # the batches' verify cost too
        for name in self.policy_specs:  # every offered policy assembles before serving
            self.pipe(name).prepare(context=longest, rows=rows)
        try:  # llguidance's tokenizer (shared by the policies), before the first request
            pipe.grammar_tokenizer()
        except specdec.RequestError:
            pass  # a constrained request gets the 400 that says why
        #: the batch of each policy that runs rows together (made on first use), and
        #: why a policy cannot (its requests then run alone, a token per turn).
        self.batches: dict[str, Any] = {}
        self.unbatched: dict[str, str] = {}
        for name in self.policy_specs:  # and says whether it can batch
            self._batch(name)
        source = specdec.loading.model_source(self.model)
        self.model_path = str(source) if source is not None else str(model)
        self.model_name = model_name or os.path.basename(os.path.normpath(self.model_path))
        self.metrics = Metrics()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self._members: dict[tuple[str, int], Job] = {}
        #: requests of policies that cannot batch: (job, its stream), a token each per loop.
        self._alone: list[tuple[Job, Any]] = []
        self._worker = threading.Thread(target=self._work, name="specdec-serve-worker", daemon=True)
        self._worker.start()

    # -- policies ------------------------------------------------------------------------

    def policy_names(self) -> list[str]:
        """What a request may name: the server's policies, then the presets."""
        return list(dict.fromkeys([*self.policy_specs, *specdec.presets.PRESETS]))

    def resolve_policy(self, name: str | None) -> str:
        """The policy a request names (``None``: the server's default).

        Raises:
            specdec.PolicyError: a name that is neither the server's nor a preset.
        """
        if name is None:
            return self.default_policy
        if name in self.policy_specs or name in specdec.presets.PRESETS:
            return name
        raise specdec.PolicyError(
            f"unknown policy {name!r}: this server offers {', '.join(self.policy_names())}"
        )

    def pipe(self, name: str) -> Any:
        """The pipeline of policy ``name``, assembled on first use (components and options
        checked; no model work: the worker calls ``prepare()`` before its first request).

        Raises:
            specdec.PolicyError, specdec.ModelLoadError: the policy cannot run here.
        """
        with self._pipes_lock:
            pipe = self.pipes.get(name)
            if pipe is None:
                pol = self.policy_specs.get(name) or specdec.load_policy(name)
                pipe = specdec.assemble(self.model, self.tokenizer, pol)
                self.pipes[name] = pipe
            return pipe

    # -- prompts -------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer has a chat template (chat requests need one)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids of chat ``messages`` (and ``tools``) through the tokenizer's chat
        template.

        Raises:
            ValueError: the model has no chat template, or the template refuses the
                messages (its own message).
        """
        if not self.has_chat_template:
            raise ValueError(
                f"{self.model_name} has no chat template: send the prompt to /v1/completions"
            )
        try:
            return self.pipes[self.default_policy].encode_messages(messages, tools=tools)
        except Exception as exc:  # jinja's TemplateError and the like: the template said no
            raise ValueError(f"the chat template refused the messages: {exc}") from exc

    def text_ids(self, prompt: str) -> list[int]:
        """Prompt ids of a completion prompt (no chat template)."""
        return [int(t) for t in self.tokenizer.encode(prompt)]

    # -- the worker ----------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job`` for the worker."""
        self.jobs.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the worker after the round it is running (waits up to ``timeout`` s)."""
        self.jobs.put(None)
        if self._worker.is_alive() and threading.current_thread() is not self._worker:
            self._worker.join(timeout)

    @property
    def running(self) -> int:
        """Requests being generated now (rows of batches, and those running alone)."""
        return sum(b.running for b in list(self.batches.values())) + len(self._alone)

    @property
    def queue_length(self) -> int:
        """Requests waiting: for the worker, or for a row of their policy's batch."""
        return self.jobs.qsize() + sum(b.queued for b in list(self.batches.values()))

    def _batch(self, policy: str) -> Any:
        """The batch of ``policy``, or ``None`` when its components cannot run rows."""
        if policy in self.unbatched:
            return None
        b = self.batches.get(policy)
        if b is None:
            try:
                b = self.pipe(policy).batch(self.max_batch)
            except specdec.PolicyError as exc:
                self.unbatched[policy] = str(exc)
                return None
            self.batches[policy] = b
        return b

    def _work(self) -> None:
        while True:
            busy = bool(self._alone) or any(len(b) for b in self.batches.values())
            try:
                job = self.jobs.get(block=not busy)
            except queue.Empty:
                job = False
            while job is not False:
                if job is None:
                    self._shutdown()
                    return
                self._take(job)
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    job = False
            for policy, b in list(self.batches.items()):
                if len(b):
                    self._round(policy, b)
            for item in list(self._alone):
                self._advance(*item)

    def _shutdown(self) -> None:
        """The server is going down: end every request still running or waiting."""
        gone = RuntimeError("the server is shutting down")
        for job in self._members.values():
            job.emit(("error", gone))
        for job, stream in self._alone:
            stream.close()
            job.emit(("error", gone))
        self._members.clear()
        self._alone.clear()
        for b in self.batches.values():
            b.close()

    def _take(self, job: Job) -> None:
        """A new job: into its policy's batch, or alone when the policy cannot batch."""
        if job.cancelled.is_set():
            with self.metrics.lock:
                self.metrics.cancelled += 1
            return
        try:
            pipe = self.pipe(job.policy)
            pipe.prepare()  # once per pipeline: e.g. the verify cost curve
            b = self._batch(job.policy)
            snap = self._fetch(job)
            if b is None:
                caches = snap.caches if snap is not None else None
                if caches is None and self.prefix is not None and self._keeps_alone:
                    caches = make_prompt_cache(self.model)  # to keep when it finishes
                job.caches, job.ordered = caches, snap.ordered if snap is not None else True
                stream = pipe.stream(job.prompt_ids, prompt_cache=caches, **job.params)
                self._alone.append((job, stream))
                return
            rid = b.add(
                job.prompt_ids, prompt_cache=snap, keep_cache=self.prefix is not None, **job.params
            )
        except Exception as exc:  # this request fails; the server and other requests go on
            self._failed(job, exc)
            return
        self._members[(job.policy, rid)] = job

    def _fetch(self, job: Job) -> Any:
        """The prefix cache's caches for ``job``'s prompt (a ``CacheSnapshot``), or ``None``.
        A failure here costs the request its prefix, never the request: it is logged and
        counted (``specdec_prefix_cache_errors_total``)."""
        if self.prefix is None:
            return None
        try:
            snap = self.prefix.fetch(job.prompt_ids)
        except Exception as exc:  # noqa: BLE001 - the request goes on without a prefix
            self._cache_error("fetch", exc)
            return None
        job.cached = 0 if snap is None else len(snap.tokens)
        return snap

    @property
    def _keeps_alone(self) -> bool:
        """Whether the caches of a request running alone can be kept: every layer of the
        model's caches tells how many tokens it holds (not so for a model of state-space
        layers only)."""
        return any(
            isinstance(getattr(c, "offset", None), int) for c in make_prompt_cache(self.model)
        )

    def _cache_error(self, what: str, exc: BaseException) -> None:
        with self.metrics.lock:
            self.metrics.prefix_errors += 1
        log.warning("prefix cache %s failed (the request goes on without it): %r", what, exc)

    def _keep(self, snapshots: Sequence[Any]) -> None:
        """Put a batch row's cache snapshots into the prefix cache (a failure is logged
        and counted, and costs only the entry)."""
        if self.prefix is None:
            return
        for snap in snapshots:
            try:
                self.prefix.insert(snap.tokens, snap.caches, ordered=snap.ordered)
            except Exception as exc:  # noqa: BLE001 - the entry is lost, nothing else
                self._cache_error("insert", exc)

    def _keep_alone(self, job: Job) -> None:
        """Put the caches of a request that ran alone into the prefix cache: they hold
        its prompt and the tokens it committed (trimmed to those it emitted, when a
        round committed more after its stop)."""
        caches = job.caches
        job.caches = None
        if self.prefix is None or caches is None:
            return
        try:
            known = [*job.prompt_ids, *job.tokens]
            lengths = {getattr(c, "offset", None) for c in caches}
            n = lengths.pop() if len(lengths) == 1 else None
            if not isinstance(n, int) or n < 1:
                return
            if n > len(known):
                # only the tokens a round committed after the stop: the newest entries,
                # at the end even of an unordered cache (its moved ones are older)
                if not can_trim_prompt_cache(caches):
                    return
                trim_prompt_cache(caches, n - len(known))
                n = len(known)
            self.prefix.insert(known[:n], caches, ordered=job.ordered)
        except Exception as exc:  # noqa: BLE001 - the entry is lost, nothing else
            self._cache_error("insert", exc)

    def _failed(self, job: Job, exc: BaseException) -> None:
        with self.metrics.lock:
            self.metrics.failed += 1
        job.emit(("error", exc))

    def _round(self, policy: str, b: Any) -> None:
        """One round of ``policy``'s batch; its events go to their jobs."""
        for (pol, rid), job in list(self._members.items()):
            if pol == policy and job.cancelled.is_set() and b.cancel(rid):
                del self._members[(pol, rid)]
                with self.metrics.lock:
                    self.metrics.cancelled += 1
        rounds, seconds = b.rounds, b.round_time_s
        try:
            events = b.step()
        except Exception as exc:  # noqa: BLE001 - a bug in the batch: its requests fail
            for (pol, rid), job in list(self._members.items()):
                if pol == policy:
                    del self._members[(pol, rid)]
                    self._failed(job, exc)
            b.close()
            self.batches.pop(policy, None)
            return
        self.metrics.rounds(b.rounds - rounds, b.round_time_s - seconds)
        for ev in events:
            job = self._members.get((policy, ev.row))
            if job is None:
                continue
            if ev.error is not None:
                del self._members[(policy, ev.row)]
                self._failed(job, ev.error)
                continue
            self._keep(ev.caches)
            r = ev.response
            job.emit(("token", r))
            if r.finish_reason is not None:
                del self._members[(policy, ev.row)]
                stats = r.stats.to_dict() if r.stats is not None else {}
                self.metrics.finished(stats)
                job.emit(("done", stats, r.finish_reason))

    def _advance(self, job: Job, stream: Any) -> None:
        """One token of a request running alone (its policy cannot batch), so that it
        takes turns with the batches' rounds."""
        done = False
        try:
            if job.cancelled.is_set():
                done = True
                with self.metrics.lock:
                    self.metrics.cancelled += 1
                return
            try:
                r = next(stream)
            except StopIteration:  # pragma: no cover - the last response ends it first
                done = True
                return
            job.emit(("token", r))
            job.tokens.append(int(r.token))
            if r.finish_reason is not None:
                done = True
                stats = r.stats.to_dict() if r.stats is not None else {}
                self.metrics.finished(stats, alone=True)
                stream.close()  # a round queued ahead is undone: the caches hold the request
                self._keep_alone(job)
                job.emit(("done", stats, r.finish_reason))
        except Exception as exc:  # this request fails; the server and other requests go on
            done = True
            self._failed(job, exc)
        finally:
            if done:
                stream.close()
                job.caches = None
                self._alone = [(j, s) for j, s in self._alone if j is not job]
