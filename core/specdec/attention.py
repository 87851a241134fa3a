"""Verify-sized attention on the CPU: bit for bit what MLX computes, in less time.

On the CPU, ``mx.fast.scaled_dot_product_attention`` falls back to plain MLX ops:
``q * scale``, ``q @ k.T``, the mask, ``softmax(precise=True)``, ``@ v``. In the
Linux ``mlx-cpu`` wheels, MLX's SIMD layer is one lane wide and its ``exp`` is a
polynomial whose six ``fma`` steps each call libm's ``fmaf``: about 15 ns per
element, 40 times numpy's ``exp``. A verify forward of 17 tokens at a
1,024-token context spends about half its time in those exponentials, so wide
verify blocks cost far more than their matmuls do.

:func:`verify_attention` replays MLX's own fallback with the same ops, shapes
and order, but computes the softmax's exponential with the same polynomial,
the same coefficients and the same rounding: each ``fma`` step is a float64
multiply-add rounded once to float32 (the product of two float32 numbers is
exact in float64), inside two ``mx.compile``-d kernels. The row maximum, the
float32 sum and the final ``exp * (1 / sum)`` are MLX's. The output is the
same bits as MLX's (checked at first use against MLX itself; a build where it
is not, or where it is not faster, keeps MLX's).

It is used only inside :func:`verify_attention` (the pipeline enters it around
its verify forwards and the cost profiler around its timed ones), only for
float32 on the CPU, and only for 2 or more queries. A score matrix of more
than :data:`MAX_SCORES` elements is computed in slices of whole K/V heads
(with their query heads) of at most that many scores each, concatenated:
attention is independent per head, and each slice is the same matmul MLX does
for those heads, so the bits do not change; past about 1.2 million scores in
one piece the replica's float64 intermediates no longer fit the cache and it
lost to MLX by 2x (measured in verify forwards on this project's 2-core
machines: 24 queries at a 7,000-token context took 1,632 ms in one piece,
634 ms in slices, 819 ms with MLX's). A call where even one K/V head's slice
is larger goes to MLX's function, like everything else.
``SPECDEC_CPU_ATTENTION=off`` turns it off; ``SPECDEC_CPU_ATTENTION=on`` uses it
whenever it is bit-identical, without the timing (what the test suite does, so that
which attention runs does not depend on how busy the machine is).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

#: Largest score matrix (batch x query heads x queries x keys) the replica computes in
#: one piece; a larger one is sliced by K/V heads (see the module docstring).
MAX_SCORES = 1 << 20

#: The first-use check keeps MLX's function unless the replica is at least this much faster.
MIN_SPEEDUP = 1.05

#: The environment variable that turns the replica off (``off``, ``0``, ``false``, ``no``)
#: or on without timing it (``on``, ``1``, ``true``, ``yes``).
ENV = "SPECDEC_CPU_ATTENTION"

# MLX's float32 exp (mlx/backend/cpu/simd/math.h): 2**round(x*log2e) times a degree-6
# polynomial in the remainder, evaluated with fma.
_LOG2E = np.float32(1.442695)
_POLY = tuple(
    float(np.float32(c))
    for c in (
        1.535336188319500e-4,
        1.339887440266574e-3,
        9.618437357674640e-3,
        5.550332471162809e-2,
        2.402264791363012e-1,
        6.931472028550421e-1,
        1.0,
    )
)
_F32_MIN = float(np.finfo(np.float32).min)


def _exp_poly(d: mx.array) -> tuple[mx.array, mx.array]:
    """The polynomial of MLX's CPU ``exp`` of float32 ``d`` and the bits of ``2**ipart``."""
    t = d * mx.array(_LOG2E, mx.float32)
    ipart = mx.floor(t + mx.array(0.5, mx.float32))
    fpart = (t - ipart).astype(mx.float64)
    p = mx.array(_POLY[0], mx.float32)
    for c in _POLY[1:]:
        # fma(p, fpart, c) in float32: the float64 product is exact, one rounding after the add.
        p = (p.astype(mx.float64) * fpart + c).astype(mx.float32)
    return p, mx.left_shift(ipart.astype(mx.int32) + 127, 23)


def _exp_scale(p: mx.array, two_i: mx.array, d: mx.array) -> mx.array:
    """``2**ipart * p``, with MLX's overflow, underflow and NaN cases."""
    r = two_i * p
    r = mx.where(d > 88.0, mx.array(np.inf, mx.float32), r)
    r = mx.where(d < -88.0, mx.array(0.0, mx.float32), r)
    return mx.where(mx.isnan(d), d, r)


# Shapeless: the context grows by a few tokens every round, and a kernel traced per
# shape would pile up in MLX's compile cache. (``view`` cannot be traced shapeless, so
# the bits become a float between the two kernels.)
_exp_poly_kernel = mx.compile(_exp_poly, shapeless=True)
_exp_scale_kernel = mx.compile(_exp_scale, shapeless=True)


def _mlx_exp(d: mx.array) -> mx.array:
    """MLX's CPU ``exp`` of float32 ``d``, bit for bit, without libm's ``fmaf``."""
    p, bits = _exp_poly_kernel(d)
    return _exp_scale_kernel(p, bits.view(mx.float32), d)


def _softmax(scores: mx.array) -> mx.array:
    """``mx.softmax(scores, axis=-1, precise=True)`` for float32, bit for bit."""
    e = _mlx_exp(scores - scores.max(axis=-1, keepdims=True))
    return e * (mx.array(1.0, mx.float32) / e.sum(axis=-1, keepdims=True))


def replica_attention(
    q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None
) -> mx.array:
    """MLX's CPU fallback of ``scaled_dot_product_attention`` (float32, no sinks), same ops.

    Args:
        q: queries ``[B, Hq, L, D]``; k, v: ``[B, Hkv, S, D]`` with ``Hq % Hkv == 0``.
        scale: the score scale.
        mask: ``None``, ``"causal"`` (queries aligned to the last keys), or an array
            broadcastable to ``[B, Hq, L, S]``: boolean (False masks) or additive.
    """
    B, n_q, L, D = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    q = mx.array(scale, q.dtype) * q
    if rep > 1:
        q = q.reshape(B, n_kv, rep, L, D)
        k = mx.expand_dims(k, 2)
        v = mx.expand_dims(v, 2)
    scores = q @ k.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, str):
            offset = S - L
            mask = mx.arange(offset, L + offset)[:, None] >= mx.arange(S)[None]
        else:
            if mask.dtype != mx.bool_:
                mask = mask.astype(scores.dtype)
            mask = mx.broadcast_to(mask, (B, n_q, L, S))
            if rep > 1:
                mask = mask.reshape(B, n_kv, rep, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(_F32_MIN, scores.dtype))
        else:
            scores = scores + mask
    out = _softmax(scores) @ v
    return out.reshape(B, n_q, L, D) if rep > 1 else out


def sliced_replica_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: Any = None,
    max_scores: int | None = None,
) -> mx.array:
    """:func:`replica_attention` in slices of whole K/V heads of at most ``max_scores``
    scores each (default :data:`MAX_SCORES`), concatenated along the heads: the same
    bits, without a score matrix that overflows the cache. One slice when it fits."""
    limit = MAX_SCORES if max_scores is None else max_scores
    B, n_q, L, _ = q.shape
    n_kv, S = k.shape[1], k.shape[2]
    rep = n_q // n_kv
    per_head = B * rep * L * S
    group = max(1, min(n_kv, limit // per_head))
    if group >= n_kv:
        return replica_attention(q, k, v, scale, mask)
    # a mask with a query-head axis (third from the right) is sliced with the heads
    head_mask = isinstance(mask, mx.array) and mask.ndim >= 3 and mask.shape[-3] == n_q > 1
    outs = []
    for h in range(0, n_kv, group):
        e = min(h + group, n_kv)
        m = mask[..., h * rep : e * rep, :, :] if head_mask else mask
        outs.append(replica_attention(q[:, h * rep : e * rep], k[:, h:e], v[:, h:e], scale, m))
    return mx.concatenate(outs, axis=1)


@dataclass
class AttentionStatus:
    """Whether verify forwards use the replica here, and why (``specdec doctor`` prints it).

    Attributes:
        enabled: the replica is in use inside :func:`verify_attention`.
        reason: why not, or what the first-use check measured.
        speedup: MLX's time over the replica's on the check's verify-sized problem.
        calls: attention calls the replica has taken in this process.
    """

    enabled: bool
    reason: str
    speedup: float | None = None
    calls: int = 0

    def describe(self) -> str:
        """What verify forwards use, and why (``specdec doctor`` and ``specdec bench`` print it)."""
        if self.enabled:
            return f"a replica of MLX's softmax ({self.reason})"
        return f"MLX's own ({self.reason})"


_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "specdec_verify_attention", default=False
)
_lock = threading.Lock()
_original: Any = None
_status: AttentionStatus | None = None


def _env_off() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0", "false", "no")


def _env_on() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("on", "1", "true", "yes")


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _takes(q: Any, k: Any, v: Any, mask: Any) -> bool:
    """Whether the replica computes this call exactly as MLX's fallback would."""
    if not (isinstance(q, mx.array) and isinstance(k, mx.array) and isinstance(v, mx.array)):
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    if not (q.dtype == k.dtype == v.dtype == mx.float32):
        return False
    B, n_q, L, D = q.shape
    n_kv = k.shape[1]
    if L < 2 or n_kv < 1 or n_q % n_kv or B * (n_q // n_kv) * L * k.shape[2] > MAX_SCORES:
        return False
    if k.shape[0] != B or v.shape[0] != B or k.shape[3] != D or v.shape[1] != n_kv:
        return False
    if n_kv < 1 or n_q % n_kv or v.shape[2] != k.shape[2]:
        return False
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return False
    if mask.dtype not in (mx.bool_, mx.float32, mx.float16, mx.bfloat16):
        return False
    try:
        np.broadcast_shapes(tuple(mask.shape), (B, n_q, L, k.shape[2]))
    except ValueError:
        return False
    return True


def _dispatch(q, k, v, *, scale, mask=None, sinks=None, stream=None, **kwargs):
    """Stands in for ``mx.fast.scaled_dot_product_attention``: the replica inside
    :func:`verify_attention` where it applies, MLX's function everywhere else."""
    if (
        _ACTIVE.get()
        and sinks is None
        and stream is None
        and not kwargs
        and _status is not None
        and _status.enabled
        and _on_cpu()
        and _takes(q, k, v, mask)
    ):
        _status.calls += 1
        return sliced_replica_attention(q, k, v, scale, mask)
    return _original(q, k, v, scale=scale, mask=mask, sinks=sinks, stream=stream, **kwargs)


def _check() -> AttentionStatus:
    """Compare the replica with MLX's function (bits), then time both on a verify-sized
    problem (17 queries, 9 heads over 3, 1,041 keys); the replica is used where it is
    identical and at least :data:`MIN_SPEEDUP` times as fast."""
    if _env_off():
        return AttentionStatus(False, f"{ENV}={os.environ.get(ENV)}")
    if not _on_cpu():
        return AttentionStatus(False, f"the default device is {mx.default_device()}")
    key = mx.random.key(7)
    ks = mx.random.split(key, 6)
    q = mx.random.normal((2, 6, 7, 16), key=ks[0]) * 3
    k = mx.random.normal((2, 2, 45, 16), key=ks[1])
    v = mx.random.normal((2, 2, 45, 16), key=ks[2])
    masks: list[Any] = [
        None,
        "causal",
        mx.random.uniform(shape=(2, 1, 7, 45), key=ks[3]) > 0.3,
        mx.where(mx.random.uniform(shape=(7, 45), key=ks[4]) > 0.2, 0.0, -1e4),
    ]
    try:
        for m in masks:
            want = np.array(_original(q, k, v, scale=0.25, mask=m))
            # in one piece, and in slices of one K/V head (a 3-head mask sliced with them)
            got = np.array(replica_attention(q, k, v, 0.25, m))
            m = mx.broadcast_to(m, (2, 6, 7, 45)) if isinstance(m, mx.array) else m
            sliced = np.array(sliced_replica_attention(q, k, v, 0.25, m, max_scores=2 * 3 * 7 * 45))
            if not (np.array_equal(want, got) and np.array_equal(want, sliced)):
                return AttentionStatus(False, "not bit-identical to MLX's attention on this build")
        if _env_on():
            return AttentionStatus(True, f"bit-identical, not timed ({ENV}={os.environ[ENV]})")
        q = mx.random.normal((1, 9, 17, 64), key=ks[5])
        k = mx.random.normal((1, 3, 1041, 64), key=ks[0])
        v = mx.random.normal((1, 3, 1041, 64), key=ks[1])
        mx.eval(q, k, v)
        times: dict[str, list[float]] = {"mlx": [], "replica": []}
        for _ in range(7):
            for name, fn in (
                ("mlx", lambda: _original(q, k, v, scale=0.125, mask="causal")),
                ("replica", lambda: replica_attention(q, k, v, 0.125, "causal")),
            ):
                t0 = time.perf_counter()
                mx.eval(fn())
                times[name].append(time.perf_counter() - t0)
    except Exception as exc:  # mx.compile needs a C++ compiler on the CPU
        return AttentionStatus(False, f"the replica failed to run: {exc}")
    # the fastest of each: other work on the machine only ever adds time
    speedup = float(min(times["mlx"]) / min(times["replica"]))
    if speedup < MIN_SPEEDUP:
        return AttentionStatus(
            False, f"not faster here ({speedup:.2f}x on 17 queries x 1,041 keys)", speedup
        )
    return AttentionStatus(
        True, f"bit-identical, {speedup:.1f}x on 17 queries x 1,041 keys", speedup
    )


def status() -> AttentionStatus:
    """The replica's status in this process (runs the first-use check if it has not run)."""
    global _status, _original
    with _lock:
        if _status is None:
            if _original is None:
                _original = mx.fast.scaled_dot_product_attention
            _status = _check()
            if _status.enabled:
                mx.fast.scaled_dot_product_attention = _dispatch
            elif not _env_off():
                log.info("specdec: verify forwards use MLX's attention: %s", _status.reason)
        return _status


@contextlib.contextmanager
def verify_attention() -> Iterator[None]:
    """Model calls inside this block use the replica where it applies (see the module).

    The first entry checks the replica against MLX and times both (about 65 ms on this
    project's 2-core machines, longer the first time MLX compiles the kernels with
    ``g++``); later entries cost a context-variable set and reset.
    """
    if _status is None:
        status()
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _original_or_mlx() -> Any:
    """MLX's own attention function, whether or not the dispatch is installed (tests)."""
    return _original or mx.fast.scaled_dot_product_attention


def _reset_for_tests() -> None:
    """Forget the check and give MLX its function back (tests only)."""
    global _status
    with _lock:
        if _original is not None:
            mx.fast.scaled_dot_product_attention = _original
        _status = None
