"""Built-in cache rollbacks and the per-request rollback plan.

* ``kv_trim``: ``KVCache``, ``QuantizedKVCache``, ``ConcatenateKVCache``,
  ``ChunkedKVCache``: trim the rejected tail (abort trims back to ``begin``).
* ``rotating_window``: ``RotatingKVCache``, exact also after the window has
  wrapped. A multi-token verify goes through mlx-lm's concatenating update,
  which may drop entries the window no longer needs; commit rebuilds the buffer
  in temporal order from the pre-round window plus the accepted new entries
  (mlx-lm's own ``trim`` only moves an index and leaves the rejected keys in
  the buffer, where a later in-place update finds them).
* ``cache_list``: ``CacheList`` and other composites, by delegating each child.
* ``batch_kv``: mlx-lm's ``BatchKVCache``, rows of a batch rolled back by different
  amounts (:class:`BatchKVRollback`).
* ``batch_rotating``: mlx-lm's ``BatchRotatingKVCache`` (sliding-window layers of a
  batch), rows rolled back by different amounts after a verify forward, also after
  the window wrapped (:class:`BatchRotatingRollback`).

A cache nothing can roll back (mlx-lm's ``ArraysCache`` for instance) makes
the request fall back to plain decoding, with the reason in ``stats``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import BatchRotatingKVCache, CacheList, dynamic_roll

from .roles import optional


class RollbackUnavailable(Exception):
    """No registered rollback supports a cache; the message says which."""


class _TrimTransaction:
    def __init__(self, cache: Any):
        self.cache = cache
        self.offset = cache.offset

    def commit(self, n_fed: int, n_keep: int) -> None:
        if n_fed > n_keep:
            self.cache.trim(n_fed - n_keep)

    def abort(self) -> None:
        extra = self.cache.offset - self.offset
        if extra > 0:
            self.cache.trim(extra)


class KVTrimRollback:
    """Rollback by trimming for caches whose ``trim(n)`` is exact."""

    name = "kv_trim"
    TYPES = tuple(
        t
        for t in (
            getattr(mlx_cache, "KVCache", None),
            getattr(mlx_cache, "QuantizedKVCache", None),
            getattr(mlx_cache, "ConcatenateKVCache", None),
            getattr(mlx_cache, "ChunkedKVCache", None),
        )
        if t is not None
    )

    def supports(self, cache: Any) -> bool:
        """Exactly the listed types (subclasses may change ``trim``)."""
        return type(cache) in self.TYPES

    def begin(self, cache: Any) -> _TrimTransaction:
        """Remember the offset."""
        return _TrimTransaction(cache)


def temporal_order(v: Any, idx: int, offset: int, keep: int) -> Any:
    """``RotatingKVCache._temporal_order`` for a buffer with the given indices."""
    if v is None:
        return None
    if idx == v.shape[2]:
        return v
    if idx < offset:
        return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
    return v[..., :idx, :]


class _RotatingTransaction:
    def __init__(self, cache: Any):
        self.cache = cache
        # ``x[...]`` is a new array object: a later in-place write to the
        # cache's buffer cannot change the snapshot.
        self.keys = None if cache.keys is None else cache.keys[...]
        self.values = None if cache.values is None else cache.values[...]
        self.offset = cache.offset
        self.idx = cache._idx

    def commit(self, n_fed: int, n_keep: int) -> None:
        """Rebuild the buffer as ``[window before begin] + [first n_keep new entries]``, in temporal order.

        Works whether the new tokens came in one concatenating update (the
        verify forward) or several in-place ones (a drafter's own cache).
        """
        drop = n_fed - n_keep
        if drop <= 0:
            return
        c = self.cache
        now_k = temporal_order(c.keys, c._idx, c.offset, c.keep)
        now_v = temporal_order(c.values, c._idx, c.offset, c.keep)
        if now_k.shape[2] < n_fed:
            raise RuntimeError(
                f"RotatingKVCache(max_size={c.max_size}) no longer holds the {n_fed} tokens fed since "
                "the transaction began; cannot roll back exactly"
            )
        start = now_k.shape[2] - n_fed
        new_k = now_k[..., start : start + n_keep, :]
        new_v = now_v[..., start : start + n_keep, :]
        old_k = temporal_order(self.keys, self.idx, self.offset, c.keep)
        old_v = temporal_order(self.values, self.idx, self.offset, c.keep)
        if old_k is None or old_k.shape[2] == 0:
            c.keys, c.values = new_k, new_v
        else:
            c.keys = mx.concatenate([old_k, new_k], axis=2)
            c.values = mx.concatenate([old_v, new_v], axis=2)
        c.offset = self.offset + n_keep
        c._idx = c.keys.shape[2]

    def abort(self) -> None:
        c = self.cache
        c.keys, c.values, c.offset, c._idx = self.keys, self.values, self.offset, self.idx


class RotatingWindowRollback:
    """Exact rollback of ``RotatingKVCache`` (sliding-window attention), also after wrapping."""

    name = "rotating_window"

    def supports(self, cache: Any) -> bool:
        """``RotatingKVCache`` exactly."""
        return type(cache) is mlx_cache.RotatingKVCache

    def begin(self, cache: Any) -> _RotatingTransaction:
        """Snapshot the buffer references and indices."""
        return _RotatingTransaction(cache)


class _CompositeTransaction:
    def __init__(self, children: list):
        self.children = children

    def commit(self, n_fed: int, n_keep: int) -> None:
        for t in self.children:
            t.commit(n_fed, n_keep)

    def abort(self) -> None:
        for t in reversed(self.children):
            t.abort()


class CacheListRollback:
    """Delegates each child of a ``CacheList`` to the rollback that supports it."""

    name = "cache_list"

    def __init__(self) -> None:
        self._plan: RollbackPlan | None = None

    def bind(self, plan: RollbackPlan) -> None:
        """Called by the plan so children can be resolved."""
        self._plan = plan

    def supports(self, cache: Any) -> bool:
        """``CacheList`` whose children are all supported."""
        if type(cache) is not getattr(mlx_cache, "CacheList", ()):
            return False
        if self._plan is None:
            return False
        return all(self._plan.find(c) is not None for c in cache.caches)

    def begin(self, cache: Any) -> _CompositeTransaction:
        """Open one transaction per child."""
        assert self._plan is not None
        return _CompositeTransaction([self._plan.find(c).begin(c) for c in cache.caches])


class RollbackPlan:
    """Which rollback handles each layer of a cache list, for one request.

    Rollbacks with an optional ``bind(plan)`` method get the plan before any
    ``supports`` call; through it they can read ``plan.caches`` and
    ``plan.model`` (a rollback that must know which layer owns a cache, such
    as a gated-delta-net one, needs the model).

    Args:
        caches: the model's per-layer caches.
        rollbacks: rollback instances in order of preference.
        forced: a rollback tried first for every layer (the policy's ``rollback``
            when it is not ``auto``).
        model: the model that owns ``caches``, when known (``None`` otherwise).
    """

    def __init__(self, caches: list, rollbacks: list, forced: Any = None, *, model: Any = None):
        self.caches = caches
        self.model = model
        self.rollbacks = ([forced] if forced is not None else []) + [
            r for r in rollbacks if r is not forced
        ]
        for r in self.rollbacks:
            bind = optional(r, "cache_rollback", "bind")
            if bind is not None:
                bind(self)
        self.assigned: list = []
        self.missing: list[str] = []
        for i, c in enumerate(caches):
            r = self.find(c)
            self.assigned.append(r)
            if r is None:
                self.missing.append(f"{type(c).__name__} (layer {i})")

    def find(self, cache: Any) -> Any:
        """The first rollback supporting ``cache``, or ``None``."""
        for r in self.rollbacks:
            try:
                if r.supports(cache):
                    return r
            except Exception:  # a plugin's supports() must not break the request
                continue
        return None

    @property
    def ok(self) -> bool:
        """Whether every layer can be rolled back."""
        return not self.missing

    @property
    def reason(self) -> str | None:
        """Why speculation is off for this cache list, or ``None``."""
        if self.ok:
            return None
        kinds = sorted({m.split(" ")[0] for m in self.missing})
        return (
            f"no cache rollback for {', '.join(kinds)} ({len(self.missing)} layer(s), e.g. {self.missing[0]}); "
            "install a plugin that registers one (e.g. specdec-plugin-qwen-mtp-gdn for gated-delta-net models)"
        )

    def names(self) -> list[str]:
        """Names of the rollbacks in use, in first-use order."""
        seen: list[str] = []
        for r in self.assigned:
            if r is not None and r.name not in seen:
                seen.append(r.name)
        return seen

    def begin(self) -> _CompositeTransaction:
        """Open a transaction over the whole cache list.

        Layers nothing can roll back get a transaction that only accepts
        ``commit(n, n)``: the pipeline never drafts for such a cache list.
        """
        return _CompositeTransaction(
            [
                _NoRollback(c) if r is None else r.begin(c)
                for r, c in zip(self.assigned, self.caches)
            ]
        )


class _NoRollback:
    def __init__(self, cache: Any):
        self.cache = cache

    def commit(self, n_fed: int, n_keep: Any) -> None:
        keeps = [n_keep] if isinstance(n_keep, int) else list(n_keep)  # one per batch row
        if any(k != n_fed for k in keeps):
            raise RuntimeError(
                f"cannot roll back {type(self.cache).__name__}: no rollback supports it"
            )

    def abort(self) -> None:
        """Nothing can be restored; the request is failing anyway."""


def build_plan(host: Any, caches: list, *, model: Any = None, policy: Any = None) -> RollbackPlan:
    """A :class:`RollbackPlan` over ``caches`` from every rollback registered with ``host``.

    Third-party rollbacks come first, so a plugin may claim a cache type a
    built-in also handles; the policy's ``rollback`` (when not ``auto``) is
    tried first for every layer, and each rollback gets its policy options.
    """
    infos = sorted(
        host.components["cache_rollback"].values(), key=lambda c: c.distribution == "specdec-core"
    )
    rollbacks = [
        host.create("cache_rollback", i.name, policy.options_for(i.name) if policy else {})
        for i in infos
    ]
    forced = None
    if policy is not None and policy.rollback != "auto":
        forced = next(r for r, i in zip(rollbacks, infos) if i.name == policy.rollback)
    return RollbackPlan(caches, rollbacks, forced, model=model)


#: Left padding shared by every row above which the batch cache is compacted.
_COMPACT_AT = 256


class _BatchKVTransaction:
    """Per-row rollback of a ``BatchKVCache`` (see :class:`BatchKVRollback`)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.idx = cache._idx
        self.offset = cache.offset

    def commit(self, n_fed: int, n_keep: int | Sequence[int]) -> None:
        c = self.cache
        keep = _per_row(n_fed, n_keep, int(c.offset.shape[0]))
        top = max(keep)
        if n_fed > top:
            c.trim(n_fed - top)
        drop = [top - k for k in keep]
        if any(drop):
            idx = c._idx
            lp = c.left_padding.tolist()
            for r, d in enumerate(drop):
                n = min(d, idx - d - lp[r])  # the row's oldest entries that fill its holes
                if d and n > 0:
                    src, dst = slice(lp[r], lp[r] + n), slice(idx - n, idx)
                    c.keys[r : r + 1, :, dst, :] = c.keys[r : r + 1, :, src, :]
                    c.values[r : r + 1, :, dst, :] = c.values[r : r + 1, :, src, :]
            d = mx.array(drop)
            c.left_padding = c.left_padding + d
            c.offset = c.offset - d
            shared = min(a + b for a, b in zip(lp, drop))
            if shared >= _COMPACT_AT and c.keys is not None:
                c.keys = c.keys[..., shared:, :]
                c.values = c.values[..., shared:, :]
                c._idx -= shared
                c.left_padding = c.left_padding - shared

    def abort(self) -> None:
        c = self.cache
        if c._idx > self.idx:
            c.trim(c._idx - self.idx)
        c.offset = self.offset


class BatchKVRollback:
    """Rollback of mlx-lm's ``BatchKVCache`` rows by different amounts.

    ``commit(n_fed, n_keep)`` takes one ``n_keep`` for every row or a sequence with
    one per row. All rows drop the rejected tail they share (a trim); a row that
    keeps ``d`` entries fewer than the row keeping most moves its ``d`` oldest
    entries into the ``d`` slots at its end and grows its left padding by ``d``, so
    its valid entries stay contiguous and right-aligned. When every row's left
    padding passes 256 the shared padding is cut off.
    """

    name = "batch_kv"
    supports_batch = True

    def supports(self, cache: Any) -> bool:
        """Exactly ``BatchKVCache``."""
        return type(cache) is getattr(mlx_cache, "BatchKVCache", ())

    def begin(self, cache: Any) -> _BatchKVTransaction:
        """Remember the write index and the rows' offsets."""
        return _BatchKVTransaction(cache)


def _per_row(n_fed: int, n_keep: int | Sequence[int], rows: int) -> list[int]:
    """``n_keep`` as one count per row, checked against ``n_fed``."""
    keep = [int(n_keep)] * rows if isinstance(n_keep, int) else [int(k) for k in n_keep]
    if len(keep) != rows or not all(0 <= k <= n_fed for k in keep):
        raise ValueError(f"commit({n_fed}, {n_keep!r}) for a batch cache of {rows} rows")
    return keep


class _BatchRotatingTransaction:
    """Per-row rollback of a ``BatchRotatingKVCache`` (see :class:`BatchRotatingRollback`)."""

    def __init__(self, cache: Any):
        self.cache = cache
        # References only: a multi-token forward replaces the buffers (mlx-lm's
        # concatenating update), so these stay as they were, and a one-token write
        # that does not wrap the ring lands past the entries they hold (abort refuses
        # where it wrapped). The per-row arrays are copied: mlx-lm decrements
        # ``left_padding`` in place.
        self.saved = (
            cache.keys,
            cache.values,
            mx.array(cache.offset),
            mx.array(cache.left_padding),
            cache._offset,
            cache._idx,
            cache.rotated,
        )

    def commit(self, n_fed: int, n_keep: int | Sequence[int]) -> None:
        c = self.cache
        keep = _per_row(n_fed, n_keep, int(c.offset.shape[0]))
        if all(k == n_fed for k in keep):
            return
        if c.keys is None or c.rotated or c._idx != c.keys.shape[2] or c._idx < n_fed:
            raise RuntimeError(
                f"BatchRotatingKVCache(max_size={c.max_size}): rows can be rolled back only "
                f"after one forward of all {n_fed} tokens (mlx-lm's concatenating update); "
                "this cache was written one token at a time"
            )
        top = max(keep)
        tail = n_fed - top
        if tail:  # rejected by every row: cut off (mlx-lm's trim would leave it in the buffer)
            c.keys = c.keys[..., : c._idx - tail, :]
            c.values = c.values[..., : c._idx - tail, :]
            c._idx -= tail
            c._offset -= tail
            c.offset = c.offset - tail
        drop = [top - k for k in keep]
        if any(drop):
            # Each row's rejected entries wrap round to its front and become padding:
            # its kept entries stay contiguous, in temporal order and right-aligned,
            # which the window mask (slot distance as position distance) needs. A row
            # whose every slot was valid (left padding below 0) starts from 0.
            d = mx.array(drop)
            c.keys = dynamic_roll(c.keys, d[:, None], axis=2)
            c.values = dynamic_roll(c.values, d[:, None], axis=2)
            c.left_padding = mx.maximum(c.left_padding, 0) + d
            c.offset = c.offset - d

    def abort(self) -> None:
        c = self.cache
        keys, values, offset, left_padding, _offset, idx, rotated = self.saved
        if c.rotated and c._offset != _offset:  # the last write was in place, on the ring
            raise RuntimeError(
                "BatchRotatingKVCache was written in place since the transaction began: "
                "the entries it overwrote cannot be restored"
            )
        c.keys, c.values, c.offset, c.left_padding = keys, values, offset, left_padding
        c._offset, c._idx, c.rotated = _offset, idx, rotated


class BatchRotatingRollback:
    """Rollback of mlx-lm's ``BatchRotatingKVCache`` rows by different amounts.

    For the target's sliding-window layers in a batch. A verify forward of ``n > 1``
    tokens goes through mlx-lm's concatenating update, which lays the buffer out in
    temporal order and keeps the window's last ``max_size - 1`` entries before the new
    ones, so every entry a row still needs is there whatever it keeps (also after the
    window wrapped). ``commit(n_fed, n_keep)`` cuts the tail every row rejected, then
    rolls each row right by what it rejected beyond that (mlx-lm's own right-padding
    move, ``dynamic_roll``) and counts those slots as its left padding. Committing
    fewer than ``n_fed`` after one-token in-place writes raises (a drafter's own
    caches need a snapshot this rollback does not take).
    """

    name = "batch_rotating"
    supports_batch = True

    def supports(self, cache: Any) -> bool:
        """Exactly ``BatchRotatingKVCache``."""
        return type(cache) is BatchRotatingKVCache

    def begin(self, cache: Any) -> _BatchRotatingTransaction:
        """Remember the buffers and indices."""
        return _BatchRotatingTransaction(cache)


def order_for_block(caches: Sequence[Any], width: int) -> None:
    """Prepare batch caches for a forward of ``width`` tokens per row.

    mlx-lm 0.32's ``BatchRotatingKVCache.make_mask`` counts a multi-token forward's
    eviction from the ring's write index, while the update first lays a wrapped ring
    out in temporal order: a row that still has left padding would lose its oldest
    valid key. Putting wrapped layers in temporal order first (what the update does
    anyway) makes the two agree. Nothing to do for a one-token forward.
    """
    if width <= 1:
        return
    for c in caches:
        for layer in c.caches if type(c) is CacheList else (c,):
            if type(layer) is BatchRotatingKVCache and layer.rotated:
                layer._temporal_order()
