"""The ``gemma4_mtp`` drafter: a Gemma 4 assistant drafts from the target's own state.

A round, for a history of ``n`` tokens (the last one, at position ``n - 1``, not yet
through the target; the target's caches hold positions ``0 .. n-2``):

1. The assistant's first step reads the target's hidden state at ``n - 2`` (after its
   final norm: the verify row that drew the last token, or the last prompt row after
   prefill) and the token ``history[-1]``; its attention reads the target's committed
   K/V (per layer type, the last layer of that type that owns a cache; a sliding
   layer's last ``window`` entries).
2. Each further step reads the previous draft and the previous step's
   ``post_projection`` output, against the same K/V and at the same RoPE position.
3. Nothing of the assistant's needs rolling back: it writes no cache. After the verify
   the target's caches are rolled back by the core, and the next round reads them.

The queries' RoPE position is the bonus token's (``n - 1``, Hugging Face's convention,
``position="bonus"``) or the last committed token's (``n - 2``, vLLM's and mlx-vlm's,
``position="last"``).

In a :class:`specdec.Batch` (:class:`Gemma4MTPBatch`) the drafting rows step together:
one assistant call per draft step for all of them, each row's query at its own RoPE
position, attending to its own row of the target's batch caches through a mask (the
left padding; a sliding layer's last ``window`` entries).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import specdec
import specdec.checkpoints
from specdec import (
    BaseDrafter,
    BaseDrafterSession,
    Draft,
    PrefillChunk,
    RequestContext,
    RoundResult,
)
from specdec.depth import AdaptiveDepth
from specdec.drafting import draw
from specdec.options import Option, Options
from specdec.roles import Ask, BatchContext

from .assistant import AssistantLoadError
from .checkpoint import load_assistant
from .target import bind_target

NAME = "gemma4_mtp"

POSITIONS = ("bonus", "last")

#: The options of ``gemma4_mtp`` (see the README).
OPTIONS = Options(
    NAME,
    [
        Option("assistant", (str, os.PathLike), accepted="a folder path"),
        Option("depth", int, minimum=1),
        Option("max_depth", int, minimum=1),
        Option("adaptive", bool, default=True),
        Option("grow_at", float, default=0.65, minimum=0, maximum=1),
        Option("shrink_below", float, default=0.3, minimum=0, maximum=1),
        Option("window", int, default=32, minimum=2),
        Option("position", str, choices=POSITIONS),
        Option(
            "centroids", str, default="auto", choices=("auto", "off"), accepted="'auto' or 'off'"
        ),
        Option(
            "sampled_drafts",
            str,
            default="sample",
            choices=("sample", "greedy"),
            accepted="'sample' or 'greedy'",
        ),
    ],
)
#: Default options of ``gemma4_mtp``.
DEFAULTS: Mapping[str, Any] = OPTIONS.defaults


class Gemma4MTPDrafter(BaseDrafter):
    """Drafts with a Gemma 4 assistant (``gemma4_assistant`` checkpoint).

    Args:
        assistant: the assistant's checkpoint folder (config.json + safetensors).
        depth: drafts per round to start from (``None``: the assistant's configured depth,
            ``block_size - 1``: 3 for Google's assistants).
        max_depth: the requested block: a ceiling the depth grows to only when at least
            ``grow_at`` of the last ``window`` rounds reached the current depth
            (``None``: ``depth``, no growth). The depth never falls below ``depth``.
        adaptive: ``False`` keeps ``depth``.
        grow_at, shrink_below, window: the :class:`specdec.depth.AdaptiveDepth` rule.
        position: the queries' RoPE position: ``"bonus"`` (the last token's, Hugging
            Face) or ``"last"`` (the last committed token's, vLLM / mlx-vlm); ``None``: the
            one an assistant trained by ``specdec train-assistant`` was trained for
            (``specdec_position`` in its config), else ``"bonus"``.
        centroids: ``"auto"`` (the centroid-masked embedder when the checkpoint has one),
            ``"off"`` (the whole tied head).
        sampled_drafts: under temperature > 0, ``"sample"`` draws each draft from the
            assistant's distribution and hands it over as ``q``; ``"greedy"`` drafts its
            argmax (point masses: a seeded run emits the seeded plain run's tokens).

    Raises:
        specdec.PolicyError: an option has a bad value (before any model work).
    """

    name = NAME
    needs = frozenset({"hidden", "kv"})
    supports_batch = True

    def __init__(self, **options: Any) -> None:
        o = OPTIONS.parse(options)
        if o.assistant is None:
            raise specdec.PolicyError(
                f"{NAME}: option assistant is required: the folder of a Gemma 4 assistant "
                "checkpoint (config.json with model_type 'gemma4_assistant' + safetensors), "
                f"e.g. options = {{'{NAME}': {{'assistant': 'path/to/gemma-4-E2B-it-assistant'}}}}"
            )
        if o.depth is not None and o.max_depth is not None and o.max_depth < o.depth:
            raise specdec.PolicyError(
                f"{NAME}: max_depth ({o.max_depth}) must be >= depth ({o.depth})"
            )
        self.assistant_path = Path(os.fspath(o.assistant)).expanduser()
        self.depth = o.depth
        self.max_depth = o.max_depth
        self.adaptive = o.adaptive
        self.grow_at = o.grow_at
        self.shrink_below = o.shrink_below
        self.window = o.window
        self.position = o.position
        self.centroids = o.centroids
        self.sampled_drafts = o.sampled_drafts
        self.module: Any = None
        self.config: Any = None
        self.binding: Any = None
        self.info: dict = {}

    def attach(self, model: Any, tokenizer: Any) -> None:
        """Load the assistant and check it against ``model`` (once per pipeline).

        Raises:
            AssistantLoadError (a :class:`specdec.ModelLoadError`): no checkpoint there,
                or an assistant that is not a pair with ``model`` (hidden size,
                vocabulary, layer types, head sizes).
        """
        if self.binding is not None and self.binding.model is model:
            return
        if self.module is None:
            from .checkpoint import read_config

            cfg = read_config(self.assistant_path)  # the pair is checked before loading
            binding = bind_target(model, cfg)
            self.module, self.config = load_assistant(self.assistant_path)
        else:
            binding = bind_target(model, self.config)
        trained_for = self.config.raw.get(specdec.checkpoints.TARGET_FIELD)
        if isinstance(trained_for, dict):
            diff = specdec.checkpoints.identity_mismatch(trained_for, model)
            if diff:
                said = ", ".join(f"{k} {a!r}, this one {b!r}" for k, (a, b) in diff.items())
                raise AssistantLoadError(
                    f"{NAME}: the assistant in {str(self.assistant_path)!r} was trained for "
                    f"another model ({said})"
                )
        if self.depth is None and self.max_depth is not None and self.max_depth < self.config.depth:
            raise specdec.PolicyError(
                f"{NAME}: max_depth ({self.max_depth}) is below the assistant's configured depth "
                f"({self.config.depth}, block_size {self.config.block_size}); set depth too, or "
                f"a max_depth of at least {self.config.depth}"
            )
        self.binding = binding
        self.position_used = self.position or self.config.raw.get("specdec_position") or "bonus"
        if self.position_used not in POSITIONS:
            raise AssistantLoadError(
                f"{NAME}: the assistant's config says specdec_position "
                f"{self.position_used!r}; expected one of {list(POSITIONS)}"
            )
        masked = self.centroids == "auto" and self.config.use_ordered_embeddings
        self.info = {
            "path": str(self.assistant_path),
            "layers": list(self.config.layer_types),
            "hidden_size": self.config.hidden_size,
            "params": self.module.n_params(),
            "configured_depth": self.config.depth,
            "donor_layers": {t: binding.donors[t].layer for t in set(self.config.layer_types)},
            "logits": "centroids" if masked else "dense",
            "position": self.position_used,
            "trained_by_specdec": isinstance(trained_for, dict),
        }

    def session(self, ctx: RequestContext) -> Gemma4MTPSession:
        """A fresh per-request state (the assistant keeps no cache of its own).

        Raises:
            AssistantLoadError: the target's cache of a layer the assistant reads is not
                one whose K/V can be read (names the layer and the cache type).
        """
        if self.binding is None or self.binding.model is not ctx.model:
            self.attach(ctx.model, ctx.tokenizer)
        self.binding.check_caches(ctx.caches, self.config.layer_types)
        return Gemma4MTPSession(self, ctx)

    def batch(self, ctx: BatchContext) -> Gemma4MTPBatch:
        """The rows of a batch drafting together (the assistant keeps no cache)."""
        if self.binding is None or self.binding.model is not ctx.model:
            self.attach(ctx.model, ctx.tokenizer)
        return Gemma4MTPBatch(self)


class Gemma4MTPSession(BaseDrafterSession):
    """One request: the target's hidden row before the last token, depth, statistics."""

    def __init__(self, drafter: Gemma4MTPDrafter, ctx: RequestContext) -> None:
        self.d = drafter
        self.module = drafter.module
        self.binding = drafter.binding
        self.cfg = drafter.config
        self.caches = ctx.caches
        self.sampler = ctx.sampler
        self.types = self.cfg.layer_types
        self.ropes = {t: self.binding.donors[t].rope for t in set(self.types)}
        self.scales = {t: self.binding.donors[t].scale for t in set(self.types)}
        self.masked = drafter.centroids == "auto" and self.cfg.use_ordered_embeddings
        base = drafter.depth if drafter.depth is not None else self.cfg.depth
        ceiling = max(base, drafter.max_depth if drafter.max_depth is not None else base)
        self.adapt = AdaptiveDepth(
            base,
            ceiling,
            adaptive=drafter.adaptive,
            grow_at=drafter.grow_at,
            shrink_below=drafter.shrink_below,
            window=drafter.window,
            min_depth=base,
        )
        self.depth = base
        self.h: mx.array | None = None  # [1, H_target]: the target's hidden at h_pos
        self.h_pos = -1
        self.last: tuple[int, int] | None = None
        self.no_state = 0
        self.batched = False  # a row of a Gemma4MTPBatch (reads the batch's caches)

    def prefill(self, chunk: PrefillChunk) -> None:
        """Keep the hidden state of the chunk's last position (the last one is what the
        first round reads)."""
        h = chunk.result.hidden
        if h is not None and h.shape[0]:
            self.h = h[-1:]
            self.h_pos = chunk.start_position + len(chunk.tokens) - 1

    def propose(self, history: Sequence[int], max_len: int) -> Draft | None:
        """Draft ``min(max_len, depth)`` tokens (lazily) from the target's state and K/V."""
        k = min(max_len, self.depth)
        n = len(history)
        if k < 1 or n < 2:
            return None
        if self.h is None or self.h_pos != n - 2:
            self.no_state += 1
            return None
        kv = self.binding.kv(self.caches, self.types)
        if kv is None:
            self.no_state += 1
            return None
        position = n - 1 if self.d.position_used == "bonus" else n - 2
        greedy = self.sampler.is_greedy or self.d.sampled_drafts == "greedy"
        state = [self.h[None]]  # [1, 1, H_target]: the state feeding the next step
        last = mx.array([history[-1]])

        def step(i: int, previous: Any) -> mx.array:
            emb = self.binding.embed_tokens(last if previous is None else previous)[None]
            normed, state[0] = self.module.hidden(
                emb, state[0], kv, self.ropes, position, self.scales
            )
            return self.module.logits(normed[0], masked=self.masked)  # [1, V]

        draft = specdec.drafting.draft_lazily(k, step, self.sampler, n, greedy=greedy)
        self.last = (n, k)
        return draft

    def observe(self, result: RoundResult) -> None:
        """Keep the verify row that drew the committed token; score our own proposal."""
        start = result.start_position
        if self.last is not None and self.last[0] == start and result.drafter == NAME:
            self._score(len(result.block), result.n_accepted)
        self.last = None
        v = result.verify
        if v is not None and v.hidden is not None:
            a = result.n_accepted
            self.h = v.hidden[a : a + 1]
            self.h_pos = start - 1 + a
        else:
            self.h = None

    def _score(self, k: int, a: int) -> None:
        self.depth = self.adapt.observe(k, a)

    def end(self) -> None:
        """Drop the request's state."""
        self.h = None
        self.caches = None

    def stats(self) -> dict:
        """Depth and its changes, per-position acceptance, what was loaded."""
        return {
            **self.adapt.stats(),
            "rounds_without_state": self.no_state,
            "batched": self.batched,
            "assistant": dict(self.d.info),
        }


class Gemma4MTPBatch:
    """The drafting rows of a :class:`specdec.Batch`, one assistant call per draft step
    for all of them (a :class:`specdec.roles.DrafterBatch`; no state of its own: the rows'
    hidden states and depths stay in their sessions, the K/V is the target's)."""

    def __init__(self, drafter: Gemma4MTPDrafter) -> None:
        self.d = drafter
        self.module = drafter.module
        self.binding = drafter.binding
        self.types = drafter.config.layer_types
        self.window = drafter.config.sliding_window
        self.sessions: dict[int, Gemma4MTPSession] = {}
        self.calls = 0  # assistant calls run, for tests
        self.joint_rounds = 0  # rounds in which two rows or more drafted in the same calls

    def join(self, row: int, session: Gemma4MTPSession) -> None:
        """The row's session no longer reads its own (prefill) caches."""
        session.caches = None
        session.batched = True
        self.sessions[row] = session

    def leave(self, rows: Sequence[int]) -> None:
        """Forget the rows."""
        for r in rows:
            self.sessions.pop(r, None)

    def propose(self, asks: Sequence[Ask], caches: list) -> list[Draft | None]:
        """Draft every ready ask's ``min(max_len, depth)`` tokens together (lazily)."""
        ready = []
        for a in asks:
            s = self.sessions[a.row]
            k, n = min(a.max_len, s.depth), len(a.history)
            if k < 1 or n < 2:
                continue
            if s.h is None or s.h_pos != n - 2:
                s.no_state += 1
                continue
            ready.append((a, s, k))
        if not ready:
            return [None] * len(asks)
        index = mx.array([a.index for a, _, _ in ready])
        kv, masks = {}, {}
        for t in dict.fromkeys(self.types):
            donor = self.binding.donors[t]
            window = self.window if t == "sliding_attention" else None
            view = specdec.kvview.kv_rows(caches[donor.layer], index, window=window)
            if view is None:
                raise AssistantLoadError(
                    f"gemma4_mtp: the target's batch cache of layer {donor.layer} is a "
                    f"{type(caches[donor.layer]).__name__}, whose K/V the assistant cannot read "
                    "per row (it reads BatchKVCache and BatchRotatingKVCache)"
                )
            keys, values, valid = view
            kv[t], masks[t] = (keys, values), valid
        bonus = self.d.position_used == "bonus"
        position = mx.array([len(a.history) - (1 if bonus else 2) for a, _, _ in ready])
        ropes = {t: self.binding.donors[t].rope for t in set(self.types)}
        scales = {t: self.binding.donors[t].scale for t in set(self.types)}
        masked = ready[0][1].masked
        state = mx.concatenate([s.h for _, s, _ in ready])[:, None]  # [R, 1, H]
        y = mx.array([a.history[-1] for a, _, _ in ready])
        steps = max(k for _, _, k in ready)
        self.joint_rounds += len(ready) > 1
        tokens: list[list] = [[] for _ in ready]
        qs: list[list] = [[] for _ in ready]
        for i in range(steps):
            emb = self.binding.embed_tokens(y)[:, None]
            normed, state = self.module.hidden(emb, state, kv, ropes, position, scales, masks)
            logits = self.module.logits(normed[:, 0], masked=masked)  # [R, V]
            self.calls += 1
            drawn = []
            for j, (a, s, k) in enumerate(ready):
                greedy = s.sampler.is_greedy or self.d.sampled_drafts == "greedy"
                y_j, q = draw(logits[j : j + 1], s.sampler, len(a.history) + i, greedy=greedy)
                if i < k:  # past its depth a row's draws only feed the shared steps
                    tokens[j].append(y_j)
                    if q is not None:
                        qs[j].append(q)
                drawn.append(y_j)
            y = mx.concatenate(drawn)
            mx.async_eval(y)
        out: dict[int, Draft] = {}
        for j, (a, s, k) in enumerate(ready):
            s.last = (len(a.history), k)
            probs = mx.stack(qs[j]) if qs[j] else None
            out[a.row] = Draft(tokens=mx.concatenate(tokens[j]), probs=probs)
        return [out.get(a.row) for a in asks]

    def observe(self, results: dict[int, RoundResult]) -> None:
        """Nothing: the sessions keep their rows' hidden states."""

    def end(self) -> None:
        """Forget every row."""
        self.sessions = {}


def create_gemma4_mtp(**options: Any) -> Gemma4MTPDrafter:
    """Factory registered as ``gemma4_mtp``.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    return Gemma4MTPDrafter(**options)
