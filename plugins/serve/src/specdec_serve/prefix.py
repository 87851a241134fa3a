"""The server's prefix cache: the model's caches of earlier requests, reused by later
requests that start with the same tokens (an agent's conversation, resent with one
more turn each time).

As ``mlx_lm.server``'s ``LRUPromptCache``: entries are a request's per-layer caches
and the token ids they hold; a request takes the entry that shares the longest prefix
with its prompt, as a deep copy (no request ever writes an entry), trimmed to the
shared prefix where the entry holds more; entries go least recently used first when
there are more than ``max_entries`` or their bytes pass ``max_bytes``. Unlike it, an
entry can be *unordered* (a row of a speculating batch whose entries a per-row rollback
moved, see :class:`specdec.CacheSnapshot`): such an entry is used only whole, as the
prefix of a longer prompt, never trimmed.

The cache is used by the engine's worker thread only; the counters are read by
``/metrics``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache
from specdec import CacheSnapshot

#: Entries kept at most, by default (as ``mlx_lm.server --prompt-cache-size``).
DEFAULT_MAX_ENTRIES = 10
#: Bytes of cached keys and values kept at most, by default.
DEFAULT_MAX_BYTES = 2 << 30


@attrs.define
class _Entry:
    tokens: np.ndarray
    caches: list
    ordered: bool
    nbytes: int


def _nbytes(caches: list) -> int:
    return int(sum(getattr(c, "nbytes", 0) or 0 for c in caches))


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """A bounded LRU cache of request caches keyed by the token ids they hold.

    Args:
        max_bytes: the entries' keys and values at most (``nbytes`` of their caches);
            an entry larger than this is not kept.
        max_entries: entries at most.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_bytes < 0 or max_entries < 1:
            raise ValueError(
                f"a prefix cache needs max_bytes >= 0 and max_entries >= 1, got "
                f"{max_bytes} and {max_entries}"
            )
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self.nbytes = 0
        #: requests that found a prefix, requests that did not, prompt tokens reused.
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0

    def __len__(self) -> int:
        return len(self._entries)

    def fetch(self, prompt: Sequence[int]) -> CacheSnapshot | None:
        """A copy of the caches that share the longest prefix with ``prompt`` (at most
        all its tokens but the last, the one the first forward is fed), trimmed to it.

        Returns:
            a :class:`specdec.CacheSnapshot` (the tokens it holds, the copy, whether its
            entries are in position order: a request that goes on from an unordered one
            holds unordered caches too), or ``None`` when no entry shares a prefix.
        """
        p = np.asarray(prompt, dtype=np.int64)
        limit = len(p) - 1
        best: tuple[int, tuple[int, ...] | None] = (0, None)
        for key, e in self._entries.items():
            n = _common(e.tokens, p)
            if n == len(e.tokens) and n <= limit:
                use = n  # the whole entry: a prefix of the prompt
            elif e.ordered and can_trim_prompt_cache(e.caches):
                use = min(n, limit)  # a part of it, trimmed
            else:
                continue
            if use > best[0]:
                best = (use, key)
        use, key = best
        if key is None:
            self.misses += 1
            return None
        e = self._entries[key]
        self._entries.move_to_end(key)
        caches = copy.deepcopy(e.caches)
        if use < len(e.tokens):
            trim_prompt_cache(caches, len(e.tokens) - use)
        self.hits += 1
        self.tokens_reused += use
        return CacheSnapshot(tuple(int(t) for t in prompt[:use]), caches, e.ordered)

    def insert(self, tokens: Sequence[int], caches: list, *, ordered: bool = True) -> bool:
        """Keep ``caches`` (the caller's; not copied, never written here), which hold
        ``tokens``. An ordered, trimmable entry replaces the entries whose tokens are a
        prefix of its own (it serves their prompts too). Returns whether it was kept."""
        key = tuple(int(t) for t in tokens)
        if not key:
            return False
        e = _Entry(np.asarray(key, dtype=np.int64), caches, ordered, _nbytes(caches))
        if e.nbytes > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        if ordered and can_trim_prompt_cache(caches):
            for k in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                self.nbytes -= self._entries.pop(k).nbytes
        self._entries[key] = e
        self.nbytes += e.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, gone = self._entries.popitem(last=False)
            self.nbytes -= gone.nbytes
        return True

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        """Entries, bytes, hits, misses and prompt tokens reused so far."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "max_entries": self.max_entries,
            "hits": self.hits,
            "misses": self.misses,
            "tokens_reused": self.tokens_reused,
        }
