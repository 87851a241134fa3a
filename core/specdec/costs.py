"""What a verify forward costs, and which block size pays best.

A speculative round feeds ``1 + k`` tokens (the last committed token and a
``k``-token block) through the target in one forward. Whether a block of ``k``
pays depends on how much more that forward costs than a one-token step, which
depends on the model, the device and the context length: on a CPU the cost
grows slowly up to about 16 tokens and steeply after, on a GPU it is nearly
flat. So it is measured, not assumed:

- :func:`profile_verify_cost` times verify forwards of several widths at several
  context lengths (random tokens, the request caches rolled back after each
  forward, the runs interleaved and the fastest of each kept: other work on a
  shared machine only ever adds time, and a curve is cached for good) and
  returns a :class:`VerifyCostCurve`.
- :class:`CostModel` is a pipeline's curve: loaded from the on-disk cache
  (``$SPECDEC_CACHE_DIR`` or ``~/.cache/specdec``, ``verify-cost/<key>.json``,
  keyed by the model's shapes, the verifier, the device and the MLX version) or
  profiled once and written there. The curve is read at the request's current
  context length (interpolated between the profiled ones, extrapolated
  linearly past the longest), and when requests run past twice the longest
  profiled context, the next request first profiles that longer context too
  (:meth:`CostModel.refresh`).
- :class:`RoundOverhead` is what a drafted round costs beyond its verify forward,
  measured on the pipeline's own rounds: plain steps are pipelined (the next
  forward is queued before the current token is read back, so the host's work
  overlaps the forward); a round that drafts is not, and neither are the few plain
  steps after it. The curve times forwards alone, so without this a block of one
  token accepted a quarter of the time looks like it pays, and does not.
- :func:`best_block` picks the block size that maximises expected committed
  tokens per second from per-position acceptance probabilities, the curve and the
  round overhead; :class:`AcceptanceEstimate` keeps those probabilities from real
  and shadow outcomes.

``specdec doctor --model M`` prints the curve of a model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from .blas import active_blas_library
from .heads import model_vocab_size
from .paths import cache_dir
from .progress import Progress
from .roles import optional

__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_WIDTHS",
    "AcceptanceEstimate",
    "BlockChoice",
    "CostModel",
    "RoundOverhead",
    "VerifyCostCurve",
    "best_block",
    "best_width",
    "cache_dir",
    "model_fingerprint",
    "profile_verify_cost",
]

#: Verify widths (tokens fed: the last token plus the block) profiled by default.
DEFAULT_WIDTHS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 17, 24, 33)
#: Context lengths profiled by default (capped by the model's maximum positions).
DEFAULT_CONTEXTS: tuple[int, ...] = (128, 1024)
#: The longest context a refresh profiles.
MAX_PROFILE_CONTEXT = 8192
#: The longest context a batch's curve is profiled at (its rows hold that many each;
#: past it the curve is extrapolated): 8 rows of 4,096 took minutes on a 2-core CPU.
MAX_BATCH_PROFILE_CONTEXT = 1024
#: Timed forwards per cell of a batch's curve (each of its forwards costs several steps).
BATCH_REPEATS = 2
#: 2: cells are the fastest of their timed forwards (1: the median of two).
_FORMAT = 2


@attrs.frozen
class VerifyCostCurve:
    """Seconds per verify forward, by width (tokens fed) and context length.

    Attributes:
        widths: the profiled widths, increasing (1 is one plain decode step).
        contexts: the profiled context lengths, increasing.
        seconds: ``seconds[i][j]``: a forward of ``widths[j]`` tokens after
            ``contexts[i]`` tokens of context (non-decreasing in the width).
        device: the device it was measured on.
        key: the cache key (model shapes, verifier, device, MLX version).
        profile_time_s: how long profiling took.
        rows: the rows of each forward (1: one request; more: a batch's ``[rows,
            width]`` forward, see :func:`profile_verify_cost`).
    """

    widths: tuple[int, ...]
    contexts: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    device: str = ""
    key: str = ""
    profile_time_s: float = 0.0
    rows: int = 1

    def __attrs_post_init__(self) -> None:
        if not self.widths or not self.contexts:
            raise ValueError("a verify cost curve needs at least one width and one context")
        if list(self.widths) != sorted(set(self.widths)) or self.widths[0] < 1:
            raise ValueError(f"widths must be increasing and >= 1, got {self.widths}")
        if list(self.contexts) != sorted(set(self.contexts)) or self.contexts[0] < 0:
            raise ValueError(f"contexts must be increasing and >= 0, got {self.contexts}")
        if len(self.seconds) != len(self.contexts) or any(
            len(r) != len(self.widths) for r in self.seconds
        ):
            raise ValueError("seconds must have one row per context and one value per width")

    def _row_cost(self, row: Sequence[float], width: float) -> float:
        ws = self.widths
        if width <= ws[0]:
            return row[0] * width / ws[0] if ws[0] > 1 else row[0]
        for j in range(1, len(ws)):
            if width <= ws[j]:
                f = (width - ws[j - 1]) / (ws[j] - ws[j - 1])
                return row[j - 1] + f * (row[j] - row[j - 1])
        if len(ws) == 1:
            return row[0] * width / ws[0]
        slope = max(0.0, (row[-1] - row[-2]) / (ws[-1] - ws[-2]))
        return row[-1] + slope * (width - ws[-1])

    def cost(self, width: int, context: int) -> float:
        """Seconds for a forward of ``width`` tokens after ``context`` tokens."""
        cs = self.contexts
        vals = [self._row_cost(r, width) for r in self.seconds]
        if context <= cs[0] or len(cs) == 1:
            return vals[0]
        for i in range(1, len(cs)):
            if context <= cs[i]:
                f = (context - cs[i - 1]) / (cs[i] - cs[i - 1])
                return vals[i - 1] + f * (vals[i] - vals[i - 1])
        slope = max(0.0, (vals[-1] - vals[-2]) / (cs[-1] - cs[-2]))
        return vals[-1] + slope * (context - cs[-1])

    def relative(self, width: int, context: int) -> float:
        """:meth:`cost` over the cost of a one-token step at the same context."""
        one = self.cost(1, context)
        return self.cost(width, context) / one if one > 0 else float(width)

    def to_dict(self) -> dict:
        """A JSON-able dict (what the disk cache holds)."""
        return {
            "format": _FORMAT,
            "widths": list(self.widths),
            "contexts": list(self.contexts),
            "seconds": [list(r) for r in self.seconds],
            "device": self.device,
            "key": self.key,
            "profile_time_s": self.profile_time_s,
            "rows": self.rows,
        }

    @classmethod
    def from_dict(cls, d: dict) -> VerifyCostCurve:
        """The inverse of :meth:`to_dict`.

        Raises:
            ValueError: the dict is not a curve of this format.
        """
        if d.get("format") != _FORMAT:
            raise ValueError(f"verify cost curve format {d.get('format')!r}, expected {_FORMAT}")
        return cls(
            widths=tuple(int(w) for w in d["widths"]),
            contexts=tuple(int(c) for c in d["contexts"]),
            seconds=tuple(tuple(float(x) for x in r) for r in d["seconds"]),
            device=str(d.get("device", "")),
            key=str(d.get("key", "")),
            profile_time_s=float(d.get("profile_time_s", 0.0)),
            rows=int(d.get("rows", 1)),
        )

    def merged(self, other: VerifyCostCurve) -> VerifyCostCurve:
        """This curve with ``other``'s contexts added (same widths; ``other`` wins on a tie)."""
        if other.widths != self.widths:
            raise ValueError("cannot merge verify cost curves with different widths")
        rows = dict(zip(self.contexts, self.seconds))
        rows.update(zip(other.contexts, other.seconds))
        cs = tuple(sorted(rows))
        return attrs.evolve(
            self,
            contexts=cs,
            seconds=tuple(rows[c] for c in cs),
            profile_time_s=self.profile_time_s + other.profile_time_s,
        )

    def table(self) -> str:
        """The curve as a text table: one row per context, cost relative to one step."""
        head = "context  1-step ms  " + "  ".join(f"{w:>5}" for w in self.widths)
        lines = [head]
        for c, row in zip(self.contexts, self.seconds):
            rel = "  ".join(f"{x / row[0]:5.2f}" if row[0] > 0 else "    -" for x in row)
            lines.append(f"{c:>7}  {row[0] * 1000:9.1f}  {rel}")
        return "\n".join(lines)


def _max_positions(model: Any) -> int | None:
    args = getattr(model, "args", None)
    for attr in ("max_position_embeddings", "max_seq_len", "context_length"):
        v = getattr(args, attr, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def model_fingerprint(model: Any, verifier: Any = None) -> str:
    """A key for what the cost of a forward depends on: parameter shapes and dtypes,
    the model's config, the verifier, the device, the MLX version, the machine, the BLAS
    MLX's CPU matmuls call (a curve profiled with the reference BLAS priced every wide
    verify about k times a step) and whether verify forwards use the CPU's attention
    replica (:mod:`specdec.attention`)."""
    from mlx.utils import tree_flatten

    from .attention import MAX_SCORES
    from .attention import status as attention_status

    h = hashlib.sha256()
    args = getattr(model, "args", None)
    try:
        cfg = vars(args) if args is not None else {}
    except TypeError:
        cfg = {}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    params = getattr(model, "parameters", None)
    for name, p in tree_flatten(params()) if callable(params) else ():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    h.update(type(model).__module__.encode())
    h.update(str(verifier.name if verifier is not None else "logits").encode())
    layers = optional(verifier, "verifier", "layers")
    h.update(repr(tuple(layers) if layers else ()).encode())
    h.update(str(mx.default_device()).encode())
    h.update(mx.__version__.encode())  # type: ignore[attr-defined]  # not in mlx's stubs
    h.update(platform.machine().encode())
    h.update(b"row=suffix-min")  # how a profiled row is made monotone (curves of before differ)
    h.update(str(os.cpu_count()).encode())
    if mx.default_device().type == mx.DeviceType.cpu:
        h.update(f"blas={os.path.basename(active_blas_library() or '?')}".encode())
    if attention_status().enabled:  # verify forwards cost less with the CPU's replica
        # (and its size rule: a curve profiled under another one priced other forwards)
        h.update(f"attention=replica;max_scores={MAX_SCORES};sliced".encode())
    return h.hexdigest()[:20]


def _state(caches: list) -> list:
    out = []
    for c in caches:
        st = getattr(c, "state", None)
        if st is None:
            continue
        out.extend(x for x in (st if isinstance(st, (list, tuple)) else [st]) if x is not None)
    return out


def profile_verify_cost(
    model: Any,
    *,
    verifier: Any = None,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    repeats: int = 4,
    host: Any = None,
    progress: Callable[[int, int, str], None] | None = None,
    seed: int = 0,
    rows: int = 1,
) -> VerifyCostCurve:
    """Time verify forwards of each width at each context length.

    For each context length, a fresh cache is filled with that many random tokens;
    then every width is fed ``repeats`` times (plus one untimed warm-up),
    interleaved, rolling the cache back after each forward through the core's
    rollback plan, so every forward sees the same context. The fastest forward
    of each cell is kept: other work on the machine only ever adds time, and a
    curve profiled while another job ran would stay in the cache with the costs
    that job inflated (the median of two, kept before format 2, did). Each row is
    made non-decreasing in the width (a wider forward never costs less).

    Args:
        model: the target mlx-lm model.
        verifier: the verifier whose ``verify`` is timed (default: logits only).
        widths: tokens per forward to time (increasing, 1 included for the ratio).
        contexts: context lengths (capped by the model's maximum positions).
        repeats: timed forwards per cell.
        host: the plugin host for the rollback plan (default: the process-wide one).
        progress: called as ``progress(done, total, label)`` after each forward.
        seed: the seed of the random tokens.
        rows: time forwards of ``rows`` rows at once, as a :class:`specdec.Batch` runs
            them (``[rows, width]`` tokens through ``verifier.verify_batch`` over mlx-lm
            batch caches holding ``rows`` copies of the context, rolled back through the
            batch rollbacks): the curve of a batch of that many rows.

    Raises:
        ValueError: empty or non-increasing widths or contexts, or repeats or rows < 1.
        RuntimeError: the model's caches cannot be rolled back (nothing to profile with).
    """
    from .verifiers import LogitsVerifier

    widths = tuple(int(w) for w in widths)
    if not widths or list(widths) != sorted(set(widths)) or widths[0] < 1:
        raise ValueError(f"widths must be increasing integers >= 1, got {widths}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
    limit = _max_positions(model)
    cs = sorted({min(int(c), limit - widths[-1] - 1) if limit else int(c) for c in contexts})
    cs = [c for c in cs if c >= 1]
    if not cs:
        raise ValueError(f"no context length to profile in {tuple(contexts)}")
    verifier = verifier or LogitsVerifier()
    total = len(cs) * len(widths) * (repeats + 1)
    done = [0]

    def tick(label: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total, label)

    t_start = time.perf_counter()
    cells = [
        _profile_context(model, verifier, c, widths, repeats, host, seed, tick, rows) for c in cs
    ]
    return VerifyCostCurve(
        widths=widths,
        contexts=tuple(cs),
        seconds=tuple(cells),
        device=str(mx.default_device()),
        key=model_fingerprint(model, verifier),
        profile_time_s=time.perf_counter() - t_start,
        rows=rows,
    )


def _profile_context(
    model: Any,
    verifier: Any,
    ctx_len: int,
    widths: tuple[int, ...],
    repeats: int,
    host: Any,
    seed: int,
    tick: Callable[[str], None],
    rows: int = 1,
) -> tuple[float, ...]:
    """One row of the curve: the fastest verify forward of each width after ``ctx_len``
    random tokens (see :func:`profile_verify_cost`), made non-decreasing in the width
    by taking, for each width, the fastest forward of that width or a wider one."""
    from mlx_lm.models.cache import BatchRotatingKVCache, make_prompt_cache

    from .attention import verify_attention
    from .plugins import rollback_plan
    from .rollback import order_for_block

    vocab = model_vocab_size(model) or 256
    caches = make_prompt_cache(model)
    prompt = mx.random.randint(0, vocab, (ctx_len,), key=mx.random.key(seed * 1_000_003 + ctx_len))
    for s in range(0, ctx_len, 512):
        with verify_attention():
            verifier.verify(model, prompt[s : s + 512], caches)
        mx.eval(_state(caches))
    if rows > 1:  # the rows of a batch, each holding the same context
        caches = [type(c).merge([c] * rows) for c in caches]
        mx.eval(_state(caches))
    ring = rows > 1 and any(isinstance(c, BatchRotatingKVCache) for c in caches)
    plan = rollback_plan(caches, model=model, host=host)
    if not plan.ok:
        raise RuntimeError(f"cannot profile verify cost: {plan.reason}")
    block = mx.random.randint(
        0, vocab, (widths[-1],), key=mx.random.key(seed * 1_000_003 + ctx_len + 1)
    )
    if rows > 1:
        block = mx.repeat(block[None], rows, axis=0)
    mx.eval(block)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(repeats + 1):
        order = widths if rep % 2 == 0 else tuple(reversed(widths))
        for w in order:
            # A one-token step writes a sliding window's ring in place, which no
            # rollback undoes: a batch's step is timed on a copy of the caches.
            trial = copy.deepcopy(caches) if w == 1 and ring else caches
            if rows > 1:
                order_for_block(trial, w)
            txn = plan.begin()
            t0 = time.perf_counter()
            with verify_attention():
                if rows > 1:
                    vr = verifier.verify_batch(model, block[:, :w], trial)
                else:
                    vr = verifier.verify(model, block[:w], trial)
            mx.eval(vr.logits)
            dt = time.perf_counter() - t0
            txn.abort()
            del trial
            mx.eval(_state(caches))
            if rep > 0:
                times[w].append(dt)
            tick(f"context {ctx_len}, width {w}")
    # Each width costs the fastest forward of that width or any wider one: non-decreasing
    # in the width, and one width slowed by the machine (another process, a page fault)
    # cannot inflate the wider ones, as a running maximum from the narrow end would.
    row: list[float] = []
    for w in reversed(widths):
        v = min(times[w])
        row.append(min(v, row[-1]) if row else v)
    return tuple(reversed(row))


class RoundOverhead:
    """What a drafted round costs beyond its verify forward, learnt from the decode loop.

    The pipeline reports each round it finishes with its *excess*: its wall time
    (from the end of the round before to the end of this one, less the time the
    stream sat suspended at its yields) minus the curve's cost of its forward.
    Rounds are of three kinds:

    - ``"plain"``: a plain step as it runs without drafting: queued before the round
      before it was read back (pipelined, the host's work overlapping the forward)
      where the loop can do that, else not. Its excess is the baseline
      (:attr:`baseline_s`), what any round costs beyond the curve: an exponential
      average (``alpha``) that starts at 0, so a few rounds move it only a little.
    - ``"drafted"``: a round that verified a block of ``drafter``'s. Drafting,
      acceptance, the commit and building the next forward no longer overlap a
      forward.
    - ``"after_draft"``: one of the plain steps right after a drafted round that are
      not pipelined because of it (the loop queues plain steps ahead again only once
      drafting has paused for a few rounds). Its cost is that drafted round's doing,
      so its excess counts towards the drafter's.

    :meth:`extra_s` is, per drafter, the excess of its drafted and after-draft
    rounds over the baseline, per drafted round: decayed sums (``decay`` per round
    observed, so the estimate follows the machine's load and relaxes towards
    ``prior_s`` while nothing is drafted), starting from ``prior_s`` with
    ``prior_rounds`` pseudo-rounds, and never below 0. Each excess is clipped to
    ``clip`` one-token steps above (half that below), so a pause of the process
    (garbage collection, another job) does not swing it.
    """

    KINDS = ("plain", "drafted", "after_draft")

    def __init__(
        self,
        *,
        prior_s: float = 0.0,
        prior_rounds: float = 2.0,
        decay: float = 0.98,
        alpha: float = 0.05,
        clip: float = 1.0,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if prior_rounds <= 0.0 or clip <= 0.0:
            raise ValueError("prior_rounds and clip must be > 0")
        self.prior_s = prior_s
        self.prior_rounds = prior_rounds
        self.decay = decay
        self.alpha = alpha
        self.clip = clip
        #: the plain steps' excess (an exponential average from 0).
        self.baseline_s = 0.0
        # per drafter, decayed: the sum of the drafted and after-draft rounds' excess,
        # how many such rounds, and how many drafted rounds
        self._sum: dict[str, float] = {}
        self._n: dict[str, float] = {}
        self._drafted: dict[str, float] = {}
        #: rounds observed, by kind.
        self.rounds = dict.fromkeys(self.KINDS, 0)
        # per drafter: the (baseline, extra) multiples of a step :meth:`steady` uses
        self._steady: dict[str, list[float | None]] = {}

    def observe(
        self, kind: str, excess_s: float, step_s: float, drafter: str | None = None
    ) -> None:
        """Learn one round.

        Args:
            kind: ``"plain"``, ``"drafted"`` or ``"after_draft"`` (see the class).
            excess_s: the round's wall time minus the curve's cost of its forward.
            step_s: the curve's cost of a one-token step at the round's context (the
                clip's unit).
            drafter: whose drafted round it was, or followed (``None``: ``""``).

        Raises:
            ValueError: an unknown ``kind``.
        """
        if kind not in self.rounds:
            raise ValueError(f"round kind must be one of {self.KINDS}, got {kind!r}")
        lim = self.clip * max(step_s, 0.0)
        x = min(max(float(excess_s), -0.5 * lim), lim)
        self.rounds[kind] += 1
        d = self.decay
        if d < 1.0:
            for table in (self._sum, self._n, self._drafted):
                for k in table:
                    table[k] *= d
        if kind == "plain":
            self.baseline_s += self.alpha * (x - self.baseline_s)
            return
        name = drafter or ""
        self._sum[name] = self._sum.get(name, 0.0) + x
        self._n[name] = self._n.get(name, 0.0) + 1.0
        self._drafted.setdefault(name, 0.0)
        if kind == "drafted":
            self._drafted[name] += 1.0

    def extra_s(self, drafter: str | None = None) -> float:
        """Seconds a round drafted by ``drafter`` costs beyond its forward and the
        baseline (``prior_s`` before any of its rounds; never below 0)."""
        name = drafter or ""
        w = self.prior_rounds
        excess = self._sum.get(name, 0.0) - self.baseline_s * self._n.get(name, 0.0)
        return max(0.0, (excess + self.prior_s * w) / (self._drafted.get(name, 0.0) + w))

    def steady(self, drafter: str | None, step_s: float, quantum: float) -> tuple[float, float]:
        """:attr:`baseline_s` and :meth:`extra_s` (seconds) read in whole multiples of
        ``quantum`` one-token steps (``step_s``: the verify cost of one at the current
        context), each moved to the nearest multiple only once the estimate is more
        than one multiple away from the one in use (hysteresis; kept per drafter).

        Timing noise of a few milliseconds then changes no block size: every run,
        and every pipeline that reads the same (shared) estimate, prices identical
        drafts alike. ``quantum <= 0`` (or ``step_s <= 0``): the
        estimates as they are.
        """
        base, extra = self.baseline_s, self.extra_s(drafter)
        if quantum <= 0.0 or step_s <= 0.0:
            return base, extra
        levels = self._steady.setdefault(drafter or "", [None, None])
        out = []
        for i, seconds in enumerate((base, extra)):
            x = seconds / step_s
            level = levels[i]
            if level is None or abs(x - level) > quantum:
                level = round(x / quantum) * quantum
                levels[i] = level
            out.append(level * step_s)
        return out[0], out[1]

    def steady_steps(self, drafter: str | None = None) -> dict:
        """The multiples :meth:`steady` last used for ``drafter``, in one-token steps:
        ``{"round": ..., "drafted": ...}`` (``None`` before its first call)."""
        levels = self._steady.get(drafter or "", [None, None])
        return {"round": levels[0], "drafted": levels[1]}

    def to_dict(self) -> dict:
        """The baseline and each drafter's extra in milliseconds, and the rounds seen
        by kind."""
        return {
            "baseline_ms": round(1e3 * self.baseline_s, 3),
            "extra_ms": {n or "-": round(1e3 * self.extra_s(n), 3) for n in sorted(self._sum)},
            "rounds": dict(self.rounds),
        }


class CostModel:
    """A pipeline's verify cost curve: from the disk cache, else profiled once.

    Args:
        model: the target model.
        verifier: the pipeline's verifier.
        host: the plugin host (for the rollback plan while profiling).
        widths / contexts / repeats: what :func:`profile_verify_cost` measures.
        curve: a curve to use as is (no cache, no profiling): tests and callers
            that measured their own.
        directory: the cache folder (default :func:`cache_dir`); ``None`` with
            ``persist=False`` keeps the curve in memory only.
        persist: read and write the disk cache.
        progress: see :func:`profile_verify_cost`; the default draws a progress
            line on stderr (redrawn on a terminal, a start and an end line otherwise).
        announce: draw that default progress line (``False``: profile silently).
        batch_curves: with ``curve``, the curves of batches by their rows (a power of
            two each, see :meth:`batch_curve`); without them a given curve prices no batch.
    """

    #: curves by key, shared by the pipelines of one process.
    _memory: dict[str, VerifyCostCurve] = {}

    def __init__(
        self,
        model: Any,
        verifier: Any = None,
        *,
        host: Any = None,
        widths: Sequence[int] = DEFAULT_WIDTHS,
        contexts: Sequence[int] = DEFAULT_CONTEXTS,
        repeats: int = 4,
        curve: VerifyCostCurve | None = None,
        directory: str | os.PathLike | None = None,
        persist: bool = True,
        progress: Callable[[int, int, str], None] | None = None,
        announce: bool = True,
        batch_curves: Mapping[int, VerifyCostCurve] | None = None,
    ) -> None:
        self.model = model
        self.verifier = verifier
        self.host = host
        self.widths = tuple(widths)
        self.contexts = tuple(contexts)
        self.repeats = repeats
        self.persist = persist
        self.directory = Path(directory) if directory is not None else None
        self.progress = progress
        self.announce = announce
        #: read the disk cache (``False``: profile again and replace it).
        self.persist_read = True
        #: why profiling failed (``None``: it did not); a failed refresh is not retried.
        self.failure: str | None = None
        self._curve = curve
        self.source = "given" if curve is not None else None
        self.longest_context = 0
        self.key = model_fingerprint(model, verifier) if curve is None else curve.key
        self._fingerprint = f"{self.key}-{'-'.join(map(str, self.widths))}"
        #: the curves of batches, by rows (:meth:`batch_curve`)
        self._batch: dict[int, VerifyCostCurve] = dict(batch_curves or {})
        #: why a batch's curve could not be profiled (``None``: it could); batches then
        #: verify the rows' blocks as proposed.
        self.batch_failure: str | None = None
        #: what a drafted round costs beyond its forward, learnt from this pipeline's
        #: rounds (:meth:`observe_round`); kept in memory only (it follows the load).
        #: Pipelines compared side by side may share one (``specdec bench`` does).
        self.overhead = RoundOverhead()

    @property
    def path(self) -> Path:
        """Where the curve is cached on disk."""
        return self._path(1)

    def _path(self, rows: int) -> Path:
        return (self.directory or cache_dir()) / "verify-cost" / f"{self._key(rows)}.json"

    def _key(self, rows: int) -> str:
        return (
            self._fingerprint
            if rows == 1
            else f"{self.key}-b{rows}-{'-'.join(map(str, self.widths))}"
        )

    @property
    def loaded(self) -> bool:
        """Whether the curve is at hand (no profiling left to do)."""
        return self._curve is not None

    def curve(self) -> VerifyCostCurve:
        """The curve: in memory, else from disk, else profiled now (and cached)."""
        if self._curve is not None:
            return self._curve
        mem = CostModel._memory.get(self._fingerprint)
        if mem is not None:
            self._curve, self.source = mem, "memory"
            return mem
        curve = self._read(1)
        if curve is not None:
            self._set(curve, "disk", write=False)
            return curve
        curve = self._profile(self.contexts)
        self._set(curve, "profiled", write=True)
        return curve

    def cost(self, width: int, context: int) -> float:
        """Seconds for a verify forward of ``width`` tokens at ``context`` (see the curve)."""
        return self.curve().cost(width, context)

    def batch_curve(self, rows: int) -> VerifyCostCurve | None:
        """The curve of forwards of ``rows`` rows (a power of two >= 2; 1 is
        :meth:`curve`): given, in memory, on disk, else profiled now at the contexts the
        single-request curve has (up to :data:`MAX_BATCH_PROFILE_CONTEXT`, the fastest of
        :data:`BATCH_REPEATS` forwards per cell; once per model,
        device and batch size, cached like :meth:`curve`; not refreshed as requests grow:
        read past its longest context, it is extrapolated).

        ``None`` when this cost model's curve was given without one for ``rows``, or
        profiling failed (:attr:`batch_failure` says why; not tried again).
        """
        if rows == 1:
            return self.curve()
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"batch curves are kept for powers of two, got rows={rows!r}")
        got = self._batch.get(rows)
        if got is not None:
            return got
        if self.source == "given" or self.batch_failure is not None:
            return None
        key = self._key(rows)
        got = CostModel._memory.get(key) or self._read(rows)
        if got is None:
            # the contexts the single-request curve has (a server's prepare(context=N)
            # included), up to MAX_BATCH_PROFILE_CONTEXT: past it, extrapolated
            have = self._curve.contexts if self._curve is not None else self.contexts
            contexts = sorted({min(c, MAX_BATCH_PROFILE_CONTEXT) for c in have})
            try:
                got = self._profile(contexts, rows=rows, repeats=min(self.repeats, BATCH_REPEATS))
            except Exception as exc:  # no batch sizing; the rows' blocks as proposed
                self.batch_failure = f"profiling {rows} rows: {type(exc).__name__}: {exc}"
                return None
            if self.persist:
                _write_atomic(self._path(rows), json.dumps(got.to_dict(), indent=1))
        CostModel._memory[key] = got
        self._batch[rows] = got
        return got

    def batch_cost(self, rows: int, width: int, context: int) -> float | None:
        """Seconds of a batch's verify forward: ``rows`` rows of ``width`` tokens each
        after ``context`` tokens. Between the powers of two around ``rows`` the cost is
        interpolated linearly in the rows (a batch of 3 reads the curves of 2 and 4;
        profiling them when they are not at hand, see :meth:`batch_curve`).

        Returns:
            The seconds, or ``None`` when a curve it needs is not at hand.
        """
        if rows <= 1:
            return self.cost(width, context)
        hi = 1 << (rows - 1).bit_length()
        upper = self.batch_curve(hi)
        if upper is None:
            return None
        if hi == rows:
            return upper.cost(width, context)
        lo = hi // 2
        lower = self.batch_curve(lo)
        if lower is None:
            return None
        a, b = lower.cost(width, context), upper.cost(width, context)
        return a + (rows - lo) / (hi - lo) * (b - a)

    def observe_round(
        self, kind: str, width: int, context: int, seconds: float, drafter: str | None = None
    ) -> None:
        """A finished round of ``kind`` (see :class:`RoundOverhead`; ``drafter``: whose
        block it verified, or followed) fed ``width`` tokens after ``context`` and took
        ``seconds`` (nothing is learnt before the curve is at hand)."""
        curve = self._curve
        if curve is None:
            return
        excess = seconds - curve.cost(width, context)
        self.overhead.observe(kind, excess, curve.cost(1, context), drafter)

    @property
    def round_overhead_s(self) -> float:
        """Seconds any round costs beyond its verify forward (:attr:`RoundOverhead.baseline_s`,
        learnt from pipelined plain steps): :func:`best_block`'s ``overhead_s``."""
        return self.overhead.baseline_s

    def draft_overhead_s(self, drafter: str | None = None) -> float:
        """Seconds a round drafted by ``drafter`` costs beyond that
        (:meth:`RoundOverhead.extra_s`): what :func:`best_block`'s ``draft_cost`` adds
        to a block of any size."""
        return self.overhead.extra_s(drafter)

    def steady_overheads(
        self, drafter: str | None, context: int, quantum: float
    ) -> tuple[float, float]:
        """:attr:`round_overhead_s` and :meth:`draft_overhead_s` read in whole multiples
        of ``quantum`` one-token steps at ``context``, with hysteresis
        (:meth:`RoundOverhead.steady`): what a drafter that wants identical drafts
        priced alike from run to run passes :func:`best_block`."""
        return self.overhead.steady(drafter, self.cost(1, context), quantum)

    def note_context(self, context: int) -> None:
        """Record a context length reached by a request (see :meth:`refresh`)."""
        if context > self.longest_context:
            self.longest_context = context

    def refresh(self) -> bool:
        """Profile a longer context when requests ran past twice the longest profiled one.

        A curve that another pipeline of this process already extended far enough
        (the same model, verifier and widths) is taken as it is instead: pipelines of
        one model then price blocks by the same measurements (profiled twice, they
        differed by the machine's noise, and so did their block sizes).

        Returns:
            Whether a longer context was profiled (and cached).
        """
        curve = self.curve()
        longest = curve.contexts[-1]
        want = min(self.longest_context, MAX_PROFILE_CONTEXT)
        limit = _max_positions(self.model)
        if limit:
            want = min(want, limit - self.widths[-1] - 1)
        if self.source == "given" or want <= 2 * longest or self.failure is not None:
            return False
        shared = CostModel._memory.get(self._fingerprint)
        if shared is not None and want <= 2 * shared.contexts[-1]:
            self._curve, self.source = shared, "memory"
            return False
        try:
            longer = self._profile((want,))
        except Exception as exc:  # keep the curve we have; do not try again
            self.failure = f"profiling context {want}: {type(exc).__name__}: {exc}"
            return False
        self._set(curve.merged(longer), "refreshed", write=True)
        return True

    def stats(self) -> dict:
        """Where the curve came from, its contexts, widths, profiling time, cache path,
        why profiling failed (``None``) and the round overhead learnt so far."""
        c = self._curve
        return {
            "round_overhead": self.overhead.to_dict(),
            "source": self.source,
            "path": str(self.path) if self.persist and self.source != "given" else None,
            "contexts": list(c.contexts) if c else [],
            "widths": list(c.widths) if c else list(self.widths),
            "profile_time_s": c.profile_time_s if c else 0.0,
            "failure": self.failure,
            "batch_rows": sorted(self._batch),
            "batch_failure": self.batch_failure,
        }

    # -- helpers -------------------------------------------------------------------

    def _read(self, rows: int) -> VerifyCostCurve | None:
        """The curve of ``rows`` rows from the disk cache, or ``None`` (not persisted,
        missing, unreadable, or of other widths or rows: profile again)."""
        if not (self.persist and self.persist_read):
            return None
        try:
            curve = VerifyCostCurve.from_dict(json.loads(self._path(rows).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return curve if curve.widths == self.widths and curve.rows == rows else None

    def _profile(
        self, contexts: Sequence[int], rows: int = 1, repeats: int | None = None
    ) -> VerifyCostCurve:
        progress = self.progress
        if progress is None and self.announce:
            progress = _stderr_progress(self._path(rows) if self.persist else None, rows)
        return profile_verify_cost(
            self.model,
            verifier=self.verifier,
            widths=self.widths,
            contexts=contexts,
            repeats=self.repeats if repeats is None else repeats,
            host=self.host,
            progress=progress,
            rows=rows,
        )

    def _set(self, curve: VerifyCostCurve, source: str, *, write: bool) -> None:
        self._curve, self.source = curve, source
        CostModel._memory[self._fingerprint] = curve
        if write and self.persist:
            _write_atomic(self.path, json.dumps(curve.to_dict(), indent=1))


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (safe against
    concurrent writers: each rename is atomic and the last one wins)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder: keep the curve in memory only
        pass


def _stderr_progress(path: Path | None, rows: int = 1) -> Callable[[int, int, str], None]:
    """A :class:`~specdec.progress.Progress` bar on stderr: redrawn on a terminal; a
    first and a last line otherwise."""
    where = f"; cached in {path}" if path is not None else ""
    what = "the verify cost" if rows == 1 else f"the verify cost of a batch of {rows} rows"
    head = f"specdec: profiling {what} on {mx.default_device()} (once{where})"
    bar: list[Progress] = []

    def draw(done: int, total: int, label: str) -> None:
        if not bar:
            bar.append(Progress(total, prefix=head, pipe="ends"))
            bar[0].start(label)
        p = bar[0]
        p.done, p.label = done, label
        p.advance(0)
        if done >= total:
            p.close()

    return draw


@attrs.frozen
class BlockChoice:
    """The outcome of :func:`best_block`.

    Attributes:
        size: the block size (0: do not draft).
        expected_tokens: expected committed tokens of the round (bonus token included).
        seconds: the expected time of the round.
        rate: ``expected_tokens / seconds``.
        gain: ``rate`` over the rate of a plain step (1.0 for ``size == 0``).
    """

    size: int
    expected_tokens: float
    seconds: float
    rate: float
    gain: float


def best_block(
    accept: Sequence[float],
    cost: Callable[[int], float],
    *,
    max_size: int | None = None,
    overhead_s: float = 0.0,
    draft_cost: Callable[[int], float] | None = None,
) -> BlockChoice:
    """The block size with the most expected committed tokens per second.

    A round that drafts ``k`` tokens commits ``1 + sum_{i<=k} prod_{j<=i} accept[j-1]``
    tokens on average and costs ``cost(1 + k) + overhead_s + draft_cost(k)``. Size
    0 (a plain step) is chosen only when no ``k`` has a higher rate; among equal
    rates the smaller block wins.

    Args:
        accept: ``accept[i]``: the probability that position ``i + 1`` of the block is
            accepted given that every position before it was.
        cost: seconds of a verify forward of ``width`` tokens.
        max_size: the largest block considered (default: ``len(accept)``).
        overhead_s: host time per round outside the forward.
        draft_cost: seconds to draft ``k`` tokens (default: free).
    """
    n = len(accept) if max_size is None else min(max_size, len(accept))
    t0 = cost(1) + overhead_s
    best = BlockChoice(0, 1.0, t0, 1.0 / t0 if t0 > 0 else math.inf, 1.0)
    base = best.rate
    p, expected = 1.0, 1.0
    for k in range(1, n + 1):
        p *= min(max(float(accept[k - 1]), 0.0), 1.0)
        expected += p
        t = cost(1 + k) + overhead_s + (draft_cost(k) if draft_cost is not None else 0.0)
        rate = expected / t if t > 0 else math.inf
        if rate > best.rate * (1.0 + 1e-9):
            best = BlockChoice(k, expected, t, rate, rate / base if base > 0 else math.inf)
        if p <= 0.0:
            break
    return best


def best_width(
    rows: Sequence[Sequence[float]],
    cost: Callable[[int], float],
    *,
    overhead_s: float = 0.0,
    least: int = 1,
) -> BlockChoice:
    """The width of a batch's verify forward with the most expected committed tokens
    per second over all its rows.

    Every row of a batch is fed as many tokens as the widest row, so a long block pays
    only when the forward it widens pays for every row. Fed ``w`` tokens per row, row
    ``r`` commits ``1 + sum_{i <= min(w - 1, k_r)} prod_{j <= i} rows[r][j - 1]`` tokens
    on average (``k_r = len(rows[r])``, its block); the round costs ``cost(w) +
    overhead_s``. Among equal rates the narrower width wins.

    Args:
        rows: per row, the acceptance estimates of its block's positions (as
            :func:`best_block`'s ``accept``; empty: a row without a block).
        cost: seconds of the batch's verify forward of ``w`` tokens per row.
        overhead_s: host time per round outside the forward.
        least: the narrowest width allowed (rows whose blocks may not be cut).

    Returns:
        A :class:`BlockChoice` whose ``size`` is the longest block the round keeps
        (the width less one), ``gain`` the rate over that of a round of plain steps.
    """
    longest = max((len(r) for r in rows), default=0)
    least = max(1, min(int(least), longest + 1))
    survive = [[1.0] for _ in rows]  # survive[r][i]: the first i of row r all accepted
    for r, probs in zip(survive, rows):
        for a in probs:
            r.append(r[-1] * min(max(float(a), 0.0), 1.0))
    t1 = cost(1) + overhead_s
    base = len(rows) / t1 if t1 > 0 else math.inf
    best: BlockChoice | None = None
    for w in range(least, longest + 2):
        expected = sum(sum(s[1 : min(w, len(s))]) for s in survive) + len(rows)
        t = cost(w) + overhead_s
        rate = expected / t if t > 0 else math.inf
        if best is None or rate > best.rate * (1.0 + 1e-9):
            gain = rate / base if base > 0 else math.inf
            best = BlockChoice(w - 1, expected, t, rate, gain)
    assert best is not None
    return best


class AcceptanceEstimate:
    """Per-position acceptance probabilities, learnt from verified and shadow outcomes.

    Position ``i`` (1-based) is *reached* when a block of at least ``i`` tokens had
    its first ``i - 1`` accepted; it is *accepted* when token ``i`` was too. The
    estimate of position ``i`` is its accepted over reached counts, shrunk
    towards the pooled rate of every position (``prior_weight`` pseudo-counts),
    which is itself shrunk towards ``prior`` with one pseudo-count per side. Counts
    decay by ``decay`` per outcome, so the estimate follows a request that moves
    from copying to writing and back.

    Args:
        max_positions: the deepest position tracked.
        prior: the pooled rate before any outcome.
        prior_weight: pseudo-counts pulling each position to the pooled rate.
        decay: the weight kept by older outcomes at each new one (1: no decay).
    """

    def __init__(
        self,
        max_positions: int = 64,
        *,
        prior: float = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.95,
    ) -> None:
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_positions = max_positions
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = decay
        self.reached = [0.0] * max_positions
        self.accepted = [0.0] * max_positions
        self.outcomes = 0

    def observe(self, proposed: int, accepted: int, *, start: int = 0) -> None:
        """Learn that ``accepted`` of a ``proposed``-token block were accepted.

        An outcome that becomes known token by token (a proposal scored against
        the tokens committed round after round) can be learnt as it unfolds:
        ``observe(m, m)`` once its first ``m`` tokens matched, then
        ``observe(p, a, start=m)`` for the positions after ``m`` (``start > 0``
        counts only positions ``start + 1`` on, and neither decays the counts nor
        counts another outcome). The sum of the parts is the whole outcome.
        """
        proposed = min(int(proposed), self.max_positions)
        start = max(0, int(start))
        if proposed <= start:
            return
        accepted = max(0, min(int(accepted), proposed))
        if start == 0:
            d = self.decay
            if d < 1.0:
                self.reached = [x * d for x in self.reached]
                self.accepted = [x * d for x in self.accepted]
            self.outcomes += 1
        for i in range(start, min(accepted + 1, proposed)):
            self.reached[i] += 1.0
            if i < accepted:
                self.accepted[i] += 1.0

    def pooled(self) -> float:
        """The acceptance rate over every position reached."""
        return (sum(self.accepted) + self.prior) / (sum(self.reached) + 1.0)

    def probs(self, n: int | None = None) -> list[float]:
        """The estimates of positions ``1 .. n`` (default: every tracked position)."""
        n = self.max_positions if n is None else min(n, self.max_positions)
        pool = self.pooled()
        w = self.prior_weight
        return [(self.accepted[i] + w * pool) / (self.reached[i] + w) for i in range(n)]

    def to_dict(self, n: int = 16) -> dict:
        """The first ``n`` estimates, the pooled rate and the number of outcomes."""
        return {
            "outcomes": self.outcomes,
            "pooled": round(self.pooled(), 4),
            "positions": [round(p, 4) for p in self.probs(n)],
        }
