"""The ``coarse_head`` draft head: rank with a coarse output layer, rescore the best exactly.

A draft step's logits come in two passes over the hidden state ``h``:

1. a coarse pass scores every token cheaply: ``quant``, a ``bits``-bit copy of the
   output layer (``quantized_matmul``); or ``pruned``, float32 rows of the ``keep``
   most frequent tokens of a corpus plus the tokens of the request's context;
2. the best ``candidates`` tokens of that pass are rescored with the real output
   layer's rows (:meth:`specdec.heads.OutputLayer.rows`: the layer's own arithmetic on
   those rows, then the model's soft-capping or logit scale).

The logits handed back are the exact logits of the candidates and ``-inf``
elsewhere, so a greedy draft is the real head's argmax whenever that token is a
candidate, and a sampled draft is drawn from ``q`` = the sampler's distribution
over the candidates (zero elsewhere), which rejection sampling needs as it is.
Verification never sees this head: output stays exactly the target's.

``kind = "auto"`` builds both coarse layers, times a whole draft-head call of each
against the full head on this device, and keeps the fastest one that is faster
than the full head (else the full head itself).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import specdec
from specdec.options import Option, Options, non_empty

from .corpus import (
    cached_frequent_tokens,
    corpus_files,
    frequent_tokens,
    variant_groups,
    with_variants,
)

NAME = "coarse_head"
#: ``auto`` picks by timing; ``full`` is the real head (nothing coarse).
KINDS = ("auto", "quant", "pruned", "full")
#: Bit widths MLX quantizes to.
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def _corpus(corpus: str) -> str:
    """``builtin``, or a text file or a folder that exists and has text files."""
    if non_empty(corpus) != "builtin":
        if not os.path.exists(os.path.expanduser(corpus)):
            raise ValueError(
                f"option corpus: no such file or folder: {corpus!r} "
                "(give 'builtin', a text file or a folder of .txt/.md/.py files)"
            )
        if not corpus_files(corpus):
            raise ValueError(
                f"option corpus: the folder {corpus!r} has no .txt, .md or .py "
                "file (give 'builtin', a text file or a folder of them)"
            )
    return corpus


#: The options of ``coarse_head``.
OPTIONS = Options(
    NAME,
    [
        Option("kind", str, default="auto", choices=KINDS, accepted=f"one of {', '.join(KINDS)}"),
        Option("candidates", int, default=64, minimum=1),
        Option(
            "bits",
            int,
            default=3,
            choices=BITS,
            accepted=f"one of {', '.join(map(str, BITS))} (the widths MLX quantizes to)",
        ),
        Option(
            "group_size",
            int,
            default=64,
            choices=GROUP_SIZES,
            accepted=f"one of {', '.join(map(str, GROUP_SIZES))}",
        ),
        Option("keep", int, default=16384, minimum=1),
        Option(
            "corpus",
            str,
            default="builtin",
            check=_corpus,
            accepted="'builtin', a text file or a folder",
        ),
        Option("context_tokens", bool, default=True),
        Option("chunk_rows", int, default=8192, minimum=1),
        Option("timing_reps", int, default=15, minimum=1),
    ],
)
#: Default options of ``coarse_head``.
DEFAULTS: Mapping[str, Any] = OPTIONS.defaults


class CoarseHead:
    """The ``coarse_head`` draft head (see the module docstring).

    Args:
        kind: ``auto``, ``quant``, ``pruned`` or ``full``.
        candidates: tokens rescored exactly per state.
        bits, group_size: the ``quant`` copy's quantization.
        keep: rows of the ``pruned`` copy (frequent tokens; the context's are added).
        corpus: where the frequencies come from: ``builtin``, a text file or a folder.
        context_tokens: the ``pruned`` pass also scores the request's context tokens and
            their variants (the same word up to case and a leading space).
        chunk_rows: rows quantized / copied at a time while building (bounds the peak).
        timing_reps: timed calls per kind for ``auto``.
    """

    name = NAME

    def __init__(self, **options: Any):
        o = OPTIONS.parse(options)
        self.kind = o.kind
        self.candidates = o.candidates
        self.bits, self.group_size = o.bits, o.group_size
        self.keep = o.keep
        self.corpus = o.corpus
        self.context_tokens = o.context_tokens
        self.chunk_rows = o.chunk_rows
        self.timing_reps = o.timing_reps
        self.vocab_size: int | None = None
        self.out: Any = None
        self.chosen: str | None = None
        self.calls = 0
        self._quant: tuple | None = None
        self._pruned: mx.array | None = None
        self._pruned_ids: mx.array | None = None
        self._in_pruned: np.ndarray | None = None
        self._groups: tuple | None = None
        #: ``(key, (rows, cols) or None)`` of the last context: one tuple, replaced whole,
        #: so sessions on other threads never see a key with another context's rows.
        self._ctx: tuple | None = None
        self.info: dict[str, Any] = {}

    # -- building --------------------------------------------------------------------

    def bind(self, model: Any, tokenizer: Any = None) -> None:
        """Read ``model``'s output layer and build the coarse layer(s) ``kind`` asks for.

        Raises:
            specdec.ModelLoadError: the output layer cannot be read as rows, or its
                hidden size is not a multiple of ``group_size`` (for ``quant``).
        """
        t0 = time.perf_counter()
        self.out = specdec.heads.output_layer(model)
        self.vocab_size = self.out.vocab_size
        self.candidates = min(self.candidates, self.vocab_size)
        self.info = {"output_layer": self.out.describe(), "kind": self.kind}
        build_s: dict[str, float] = {}
        want = ("quant", "pruned") if self.kind == "auto" else (self.kind,)
        if "quant" in want:
            if self.out.hidden_size % self.group_size:
                if self.kind == "quant":
                    raise specdec.ModelLoadError(
                        f"{NAME}: hidden size {self.out.hidden_size} is not a multiple of "
                        f"group_size {self.group_size}; set group_size to one of "
                        f"{[g for g in GROUP_SIZES if self.out.hidden_size % g == 0] or 'none'}"
                        " or use kind 'pruned'"
                    )
                self.info["quant_skipped"] = (
                    f"hidden size {self.out.hidden_size} is not a multiple of group_size "
                    f"{self.group_size}"
                )
            else:
                t = time.perf_counter()
                self._build_quant()
                build_s["quant"] = time.perf_counter() - t
        if "pruned" in want:
            t = time.perf_counter()
            self._build_pruned(tokenizer)
            build_s["pruned"] = time.perf_counter() - t
        self.info["build_s"] = {k: round(v, 4) for k, v in build_s.items()}
        if self.kind == "auto":
            self._choose()
        else:
            self.chosen = self.kind
        # Free what was built and not chosen.
        if self.chosen != "quant":
            self._quant = None
        if self.chosen != "pruned":
            self._pruned = self._pruned_ids = self._in_pruned = self._groups = None
        self.info["chosen"] = self.chosen
        self.info["extra_bytes"] = self.extra_bytes
        self.info["bind_s"] = round(time.perf_counter() - t0, 4)

    def _build_quant(self) -> None:
        parts: list[tuple] = []
        for a in range(0, self.vocab_size, self.chunk_rows):
            w = self.out.dense(a, min(a + self.chunk_rows, self.vocab_size))
            q = mx.quantize(w, group_size=self.group_size, bits=self.bits)
            mx.eval(q)
            parts.append(q)
        wq, sc, bi = (mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        mx.eval(wq, sc, bi)
        self._quant = (wq, sc, bi)

    def _build_pruned(self, tokenizer: Any) -> None:
        keep = min(self.keep, self.vocab_size)
        if tokenizer is None:
            ids, info = frequent_tokens(None, [], self.vocab_size, keep)
            info["note"] = "no tokenizer: the lowest token ids"
        else:
            folder = specdec.paths.cache_dir() / "coarse-head"
            ids, info = cached_frequent_tokens(
                tokenizer, self.corpus, self.vocab_size, keep, folder
            )
        parts = []
        for a in range(0, len(ids), self.chunk_rows):
            rows = self.out.take(mx.array(ids[a : a + self.chunk_rows])).astype(mx.float32)
            mx.eval(rows)
            parts.append(rows)
        self._pruned = mx.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
        self._pruned_ids = mx.array(ids)
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[ids] = True
        self._in_pruned = mask
        if tokenizer is not None and self.context_tokens:
            self._groups = variant_groups(tokenizer, self.vocab_size)
            info["context_variants"] = self._groups is not None
        mx.eval(self._pruned, self._pruned_ids)
        self.info["pruned"] = {"rows": int(len(ids)), **info}

    def _timings(self, kinds: Sequence[str]) -> dict[str, float]:
        """Median seconds of one draft-head call per kind (interleaved, after a warm-up)."""
        # a hidden state in the layer's dtype, as a drafter of that model hands over
        h = mx.random.normal((1, self.out.hidden_size), key=mx.random.key(3)).astype(self.out.dtype)
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        for rep in range(self.timing_reps + 1):
            for k in kinds:
                t = time.perf_counter()
                mx.eval(self._logits(k, h, None))
                if rep:  # the first round warms up
                    samples[k].append(time.perf_counter() - t)
        return {k: float(np.median(v)) for k, v in samples.items()}

    def _choose(self) -> None:
        kinds = ["full"] + [
            k
            for k, built in (("quant", self._quant), ("pruned", self._pruned))
            if built is not None
        ]
        times = self._timings(kinds)
        full = times["full"]
        best = min((k for k in kinds if k != "full"), key=lambda k: times[k], default=None)
        if best is not None and times[best] < full:
            self.chosen = best
            why = f"{best} takes {times[best] / full:.2f} of the full head's time"
        else:
            self.chosen = "full"
            why = "no coarse layer is faster than the full head on this device"
        self.info["timings_ms"] = {k: round(1e3 * v, 4) for k, v in times.items()}
        self.info["why"] = why

    @property
    def extra_bytes(self) -> int:
        """Bytes of the coarse layer kept (0 for the full head)."""
        arrays = list(self._quant or ()) + [self._pruned, self._pruned_ids]
        return int(sum(a.nbytes for a in arrays if a is not None))

    # -- drafting --------------------------------------------------------------------

    def _context_extra(self, context: Sequence[int] | None) -> tuple | None:
        """``(rows [e, H] float32, ids of every column [keep + e])`` of the context's
        tokens, and their case and word-start variants, that the pruned rows do not
        hold (cached for one context object: a drafter's draft steps of one round)."""
        if context is None or not self.context_tokens or not len(context):
            return None
        # keyed on the tokens themselves: a round's draft steps hit it, another request
        # (whatever its list's id) does not
        key = tuple(context)
        cached = self._ctx
        if cached is not None and cached[0] == key:
            return cached[1]
        ctx = np.unique(np.asarray(context, dtype=np.int64))
        ctx = with_variants(ctx[(ctx >= 0) & (ctx < self.vocab_size)], self._groups)
        extra = ctx[~self._in_pruned[ctx]]
        value = None
        if extra.size:
            ids = mx.array(extra.astype(np.int32))
            rows = self.out.take(ids).astype(mx.float32)
            cols = mx.concatenate([self._pruned_ids, ids])
            mx.eval(rows, cols)
            value = (rows, cols)
        self._ctx = (key, value)
        return value

    def _coarse(
        self, kind: str, h: mx.array, context: Sequence[int] | None
    ) -> tuple[mx.array, mx.array | None]:
        """Coarse scores ``[n, m]`` and the token id of each column (``None``: column = id)."""
        if kind == "quant":
            wq, sc, bi = self._quant
            s = mx.quantized_matmul(
                h.astype(sc.dtype),
                wq,
                sc,
                bi,
                transpose=True,
                group_size=self.group_size,
                bits=self.bits,
            )
            return s, None
        h = h.astype(mx.float32)
        s = h @ self._pruned.T
        extra = self._context_extra(context)
        if extra is None:
            return s, self._pruned_ids
        rows, cols = extra
        return mx.concatenate([s, h @ rows.T], axis=-1), cols

    def _logits(self, kind: str, h: mx.array, context: Sequence[int] | None) -> mx.array:
        if kind == "full":
            return self.out.logits(h)
        scores, col_ids = self._coarse(kind, h, context)
        c = min(self.candidates, scores.shape[-1])
        top = mx.argpartition(-scores, kth=c - 1, axis=-1)[:, :c]
        ids = top if col_ids is None else col_ids[top]
        exact = self.out.rows(h, ids)  # [n, c]
        out = mx.full((h.shape[0], self.vocab_size), -mx.inf, dtype=mx.float32)
        return mx.put_along_axis(out, ids, exact, axis=-1)

    def logits(self, hidden: mx.array, context: Sequence[int] | None = None) -> mx.array:
        """Draft logits ``[n, V]`` for ``hidden`` ``[n, H]`` (or ``[B, n, H]``): the exact
        logits of the ``candidates`` best tokens of the coarse pass, ``-inf`` elsewhere
        (the full head's logits when ``full`` was chosen). ``context``: the request's
        tokens so far (their rows join the ``pruned`` pass)."""
        if self.out is None:
            raise RuntimeError(f"draft head {NAME!r} is not bound to a model (bind(model) first)")
        self.calls += 1
        if hidden.ndim == 3:
            b, n, hs = hidden.shape
            return self.logits(hidden.reshape(b * n, hs), context).reshape(b, n, -1)
        return self._logits(self.chosen, hidden, context)

    def stats(self) -> dict:
        """The choice, the timings behind it, build time, extra memory, calls."""
        return {"name": NAME, "calls": self.calls, "candidates": self.candidates, **self.info}


def create_coarse_head(**options: Any) -> CoarseHead:
    """Factory registered as ``coarse_head``.

    Raises:
        specdec.PolicyError: an unknown option (naming the accepted ones) or a bad value.
    """
    return CoarseHead(**options)
