"""A read-only view of the target's K/V, in temporal order (for drafters that read it).

:func:`kv_views` turns a model's cache list into one :class:`KVView` per layer:
the keys and values a query at the next position attends to (besides its own),
oldest first, for plain (``KVCache``), quantized (``QuantizedKVCache``,
dequantized) and rotating (``RotatingKVCache``, also after the window wrapped)
caches. Layers whose cache holds no K/V (recurrent ``ArraysCache`` layers,
composites) get ``None``. :func:`kv_rows` reads rows of a batch's caches
(``BatchKVCache``, ``BatchRotatingKVCache``) with a mask of each row's entries.

The arrays are new array objects (slices or reorderings of the buffers), so
writing to them cannot change the cache, and a later cache update cannot
change a view already taken. When a drafter's ``propose`` runs, the view holds
``history[:-1]`` (the rule in :mod:`specdec.roles`).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models import cache as mlx_cache

from .rollback import temporal_order


@attrs.frozen
class KVView:
    """One layer's keys and values in temporal order.

    Attributes:
        keys, values: ``[batch, kv_heads, length, head_dim]`` arrays.
        length: number of entries (``keys.shape[2]``).
        offset: tokens fed to this cache so far (the next token's position).
        positions: absolute position of each entry, oldest first.
        window: the sliding window size of a rotating cache (``None`` otherwise).
    """

    keys: Any
    values: Any
    length: int
    offset: int
    positions: tuple
    window: int | None = None


def _rotating(c: Any, full_window: bool) -> KVView | None:
    if c.keys is None:
        return None
    keep = c.keep
    k = temporal_order(c.keys, c._idx, c.offset, keep)
    v = temporal_order(c.values, c._idx, c.offset, keep)
    w = min(c.offset, c.max_size if full_window else c.max_size - 1, k.shape[2])
    if keep and w > keep:
        k = mx.concatenate([k[..., :keep, :], k[..., k.shape[2] - (w - keep) :, :]], axis=2)
        v = mx.concatenate([v[..., :keep, :], v[..., v.shape[2] - (w - keep) :, :]], axis=2)
        positions = tuple(range(keep)) + tuple(range(c.offset - (w - keep), c.offset))
    else:
        k, v = k[..., k.shape[2] - w :, :], v[..., v.shape[2] - w :, :]
        positions = tuple(range(c.offset - w, c.offset))
    return KVView(k, v, w, c.offset, positions, c.max_size)


def kv_view(cache: Any, *, full_window: bool = False) -> KVView | None:
    """The view of one layer's cache, or ``None`` when it holds no K/V.

    Args:
        full_window: for a rotating cache, the last ``window`` entries (what a query that
            adds no key of its own attends to, such as the Gemma 4 assistant's) instead of
            the last ``window - 1`` (what the target's own query at the next position
            attends to besides its own key). Other caches are read the same either way.
    """
    t = type(cache)
    if t is mlx_cache.RotatingKVCache:
        return _rotating(cache, full_window)
    if t is getattr(mlx_cache, "QuantizedKVCache", None):
        if cache.keys is None:
            return None
        o = cache.offset

        def deq(q: tuple) -> mx.array:
            w, s, b = (x[..., :o, :] for x in q)
            return mx.dequantize(w, s, b, group_size=cache.group_size, bits=cache.bits)

        return KVView(deq(cache.keys), deq(cache.values), o, o, tuple(range(o)))
    keys = getattr(cache, "keys", None)
    if isinstance(keys, mx.array) and hasattr(cache, "offset"):
        o = cache.offset
        return KVView(keys[..., :o, :], cache.values[..., :o, :], o, o, tuple(range(o)))
    return None


def kv_rows(cache: Any, rows: mx.array, *, window: int | None = None) -> tuple | None:
    """``(keys, values, mask)`` of ``rows`` of a batch cache, for queries that add no key
    of their own: keys and values ``[R, kv_heads, S, head_dim]`` (a wrapped ring laid out
    in temporal order), ``mask`` ``[R, 1, 1, S]`` (boolean), true on the row's entries
    (past its left padding; with ``window``, only the last ``window`` slots). A
    ``BatchKVCache`` row's entries are in no particular order (its rollback moves a few;
    attention does not depend on it). ``None`` for a cache of another type.
    """
    t = type(cache)
    if t is mlx_cache.BatchKVCache:
        keys, values = cache.keys[..., : cache._idx, :], cache.values[..., : cache._idx, :]
    elif t is mlx_cache.BatchRotatingKVCache:
        keys, values = cache.keys, cache.values
        if cache.rotated:
            keys = mx.roll(keys, -cache._idx, 2)
            values = mx.roll(values, -cache._idx, 2)
        else:
            keys, values = keys[..., : cache._idx, :], values[..., : cache._idx, :]
    else:
        return None
    keys, values = keys[rows], values[rows]
    size = keys.shape[2]
    slot = mx.arange(size)[None, :]
    valid = slot >= mx.maximum(cache.left_padding[rows], 0)[:, None]
    if window is not None:
        valid = valid & (slot >= size - window)
    return keys, values, valid[:, None, None, :]


def kv_views(caches: list, *, full_window: bool = False) -> list[KVView | None]:
    """:func:`kv_view` of every layer cache, in layer order."""
    return [kv_view(c, full_window=full_window) for c in caches]
