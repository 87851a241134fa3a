"""CopyStore: earlier requests' outputs, for copying across requests.

Agent loops re-emit what they produced before (a file written again with a fix,
a plan restated, a tool call repeated) in requests whose context no longer holds
the earlier answer. A :class:`CopyStore` keeps earlier outputs, one *document*
per request, and answers "where did the end of this history occur before, and
what followed it there?" (:meth:`CopyStore.lookup`). ``ngram_copy`` asks it when
the current context has no match.

Matching. An exact n-gram index over the stored documents, with two levels of
hash chains (as zlib's): the n-grams of ``max_n`` tokens and those of ``min_n``
tokens. A lookup tries the last ``max_n`` tokens of the history first: every
stored occurrence of them (the ``max_candidates`` most recent) is extended
backwards, up to ``max_extend`` tokens, and the longest wins, then the most
recent. When the ``max_n`` tokens never occurred, the same is done with the last
``min_n`` tokens (the matches are then shorter than ``max_n``). Every candidate is
compared token by token (a hash collision never produces a wrong match), a match
never extends across the start of its document, and a continuation stops at the
end of its document, so nothing is ever matched across a document boundary.
Later documents are more recent than earlier ones, and within one a later
position is more recent. The cost of a lookup is bounded by ``max_candidates``
comparisons of at most ``max_extend`` tokens; most candidates are rejected with
one comparison (the token at the distance the best match so far reaches).

Bound. At most ``max_tokens`` tokens: when an added document makes the store
larger, the oldest documents are dropped (a single document longer than
``max_tokens`` keeps its first ``max_tokens`` tokens).

On disk (``path``). The file holds every document; each write (an add, a clear)
takes an exclusive :func:`fcntl.flock` on ``<path>.lock``, re-reads the file
(so documents other processes added are kept), appends or trims, writes a
temporary file in the same folder and :func:`os.replace` s it over the path, so a
reader (which takes no lock) always sees a whole file, and concurrent writers in
any number of processes never lose each other's documents. A store reloads the
file when it changed since it last read or wrote it (:meth:`CopyStore.refresh`,
which ``ngram_copy`` calls once per request; documents are immutable and have
increasing ids, so a reload only indexes the documents that are new and drops
the ones that are gone). A file that is not a store, or is corrupt, raises
:class:`CopyStoreError` naming the path; it is never silently reset.

File format (version 1, little-endian)::

    magic      8 bytes   b"SDNGSTOR"
    version    u32       1
    flags      u32       0 (reserved)
    epoch      u64       random, chosen when the file is created or cleared
    next_id    u64       the id the next document gets
    n_docs     u32
    n_docs times:
        id     u64       increasing, < next_id
        length u32
        tokens length x u32
    crc32      u32       zlib.crc32 of every byte before it

The module is pure Python and does not import specdec.
"""

from __future__ import annotations

import bisect
import os
import secrets
import struct
import sys
import tempfile
import threading
import zlib
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = ["FORMAT_VERSION", "MAGIC", "CopyStore", "CopyStoreError", "StoreMatch"]

#: The first bytes of a store file.
MAGIC = b"SDNGSTOR"
#: The file format version this module reads and writes.
FORMAT_VERSION = 1

_HEADER = struct.Struct("<8sIIQQI")  # magic, version, flags, epoch, next_id, n_docs
_DOC = struct.Struct("<QI")  # id, length
_CRC = struct.Struct("<I")
_MAX_TOKEN = (1 << 32) - 1
#: An array typecode of 4-byte unsigned integers (the tokens' width in the file).
_U32 = "I" if array("I").itemsize == 4 else "L"
assert array(_U32).itemsize == 4


class CopyStoreError(ValueError):
    """A store file that is not a store, has another version, or is corrupt."""


class StoreMatch(NamedTuple):
    """Where the end of a history occurred in the stored documents.

    Attributes:
        position: the store position of the token that followed the occurrence
            (the first token a copy proposes).
        length: how many tokens match, backwards from ``position - 1`` and from the
            end of the history (at least ``n``; capped at ``max_extend``).
        n: the n-gram size whose chain found the match (``max_n`` or ``min_n``).
        doc_id: the id of the document it lies in.
    """

    position: int
    length: int
    n: int
    doc_id: int


class _Doc(NamedTuple):
    id: int
    start: int  # store position of its first token
    end: int  # one past its last token


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _u32_array(tokens: Iterable[int]) -> array:
    out = array(_U32)
    try:
        out.extend(int(t) for t in tokens)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"store tokens must be integers in [0, {_MAX_TOKEN}]: {exc}") from None
    return out


class CopyStore:
    """Earlier requests' outputs with an n-gram index over them (see the module docstring).

    Args:
        path: the file that holds the store (shared by every process that names it);
            ``None`` keeps it in memory only.
        max_tokens: the most tokens kept; the oldest documents are dropped beyond it.
        min_n: the shortest match (in tokens).
        max_n: the longer n-gram indexed (``>= min_n``).
        max_candidates: occurrences compared per chain and lookup.
        max_extend: the longest backwards extension measured; longer matches tie
            and the most recent wins.

    Raises:
        ValueError: a bound is not a positive integer, or ``min_n > max_n``.
        CopyStoreError: the file at ``path`` is not a store of this version, or corrupt.
        OSError: the file cannot be read.
    """

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        max_tokens: int = 200_000,
        min_n: int = 2,
        max_n: int = 8,
        max_candidates: int = 64,
        max_extend: int = 64,
    ) -> None:
        for label, value in (
            ("max_tokens", max_tokens),
            ("min_n", min_n),
            ("max_n", max_n),
            ("max_candidates", max_candidates),
            ("max_extend", max_extend),
        ):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
        if min_n > max_n:
            raise ValueError(f"min_n ({min_n}) must be <= max_n ({max_n})")
        self.path = None if path is None else os.fspath(path)
        self.max_tokens = max_tokens
        self.min_n = min_n
        self.max_n = max_n
        self.levels = (max_n, min_n) if max_n > min_n else (min_n,)
        self.max_candidates = max_candidates
        self.max_extend = max(max_extend, max_n)
        self._lock = threading.RLock()
        self._epoch: int | None = None  # of the file the documents came from
        self._next_id = 0
        self._sig: tuple | None = None  # (dev, ino, size, mtime_ns) of the file last seen
        self.reloads = 0  # times the file was (re)read
        self._reset_memory()
        if self.path is not None:
            self.refresh()

    # -- contents ------------------------------------------------------------------

    def __len__(self) -> int:
        """Tokens stored."""
        return len(self._tokens)

    @property
    def n_tokens(self) -> int:
        """Tokens stored (all documents)."""
        return len(self._tokens)

    @property
    def n_documents(self) -> int:
        """Documents stored."""
        return len(self._docs)

    def documents(self) -> list[list[int]]:
        """The stored documents, oldest first (copies)."""
        with self._lock:
            b = self._base
            return [self._tokens[d.start - b : d.end - b] for d in self._docs]

    def document_ids(self) -> list[int]:
        """The stored documents' ids, oldest first."""
        with self._lock:
            return [d.id for d in self._docs]

    # -- writing -------------------------------------------------------------------

    def add(self, tokens: Iterable[int]) -> None:
        """Store one request's output as a new document (an empty one is ignored).

        On disk: under the lock, the file is re-read, the document appended, the
        oldest documents dropped past ``max_tokens``, and the file replaced.

        Raises:
            ValueError: a token is not an integer in ``[0, 2**32 - 1]``.
            CopyStoreError: the file is not a store of this version, or corrupt.
            OSError: the file cannot be read or written.
        """
        doc = _u32_array(tokens)
        if not doc:
            return
        if len(doc) > self.max_tokens:
            del doc[self.max_tokens :]
        with self._lock:
            if self.path is None:
                self._append(self._next_id, doc)
                self._next_id += 1
                self._trim(self.max_tokens)
                return
            with self._file_lock():
                epoch, next_id, docs = self._read_file()
                if epoch is None:
                    epoch = secrets.randbits(64)
                docs.append((next_id, doc))
                next_id += 1
                total = sum(len(t) for _, t in docs)
                drop = 0
                while total > self.max_tokens:
                    total -= len(docs[drop][1])
                    drop += 1
                docs = docs[drop:]
                self._write_file(epoch, next_id, docs)
                self._apply(epoch, next_id, docs)

    def clear(self) -> None:
        """Drop every document (on disk: the file is replaced by an empty store)."""
        with self._lock:
            if self.path is None:
                self._reset_memory()
                return
            with self._file_lock():
                epoch = secrets.randbits(64)
                self._write_file(epoch, 0, [])
                self._apply(epoch, 0, [])

    def refresh(self) -> bool:
        """Reload the file when it changed since this store last read or wrote it.

        A missing file is an empty store. Cheap when nothing changed (one ``stat``);
        a reload indexes only the documents that are new.

        Returns:
            Whether the documents were reloaded.

        Raises:
            CopyStoreError: the file is not a store of this version, or corrupt.
            OSError: the file cannot be read.
        """
        if self.path is None:
            return False
        with self._lock:
            try:
                st = os.stat(self.path)
            except FileNotFoundError:
                if self._sig is None and self._epoch is None:
                    return False
                self._sig = None
                self._epoch = None
                self._next_id = 0
                self._reset_memory()
                return True
            if self._signature(st) == self._sig:
                return False
            epoch, next_id, docs = self._read_file()
            if epoch is None:  # removed between the stat and the read
                self._sig, self._epoch, self._next_id = None, None, 0
                self._reset_memory()
            else:
                self._apply(epoch, next_id, docs)
            return True

    # -- lookup --------------------------------------------------------------------

    def match(self, history: Sequence[int]) -> StoreMatch | None:
        """The longest, then most recent, stored occurrence of the end of ``history``
        (at least ``min_n`` tokens), or ``None``."""
        cap = self.max_extend
        tail = [int(t) for t in history[-cap:]] if len(history) else []
        end = len(tail)
        if end < self.min_n:
            return None
        with self._lock:
            toks = self._tokens
            base = self._base
            for li, n in enumerate(self.levels):
                if n > end:
                    continue
                suffix = tail[end - n :]
                pos = self._heads[li].get(hash(tuple(suffix)), -1)
                prev = self._prevs[li]
                best_pos = best_len = -1
                for _ in range(self.max_candidates):
                    if pos < base:
                        break
                    i = pos - base
                    lo = self._doc_at(pos).start - base  # the match stays in its document
                    # A longer match than the best must agree at distance best_len.
                    if best_len < 0 or (
                        i - 1 - best_len >= lo
                        and best_len < end
                        and toks[i - 1 - best_len] == tail[end - 1 - best_len]
                    ):
                        if toks[i - n : i] == suffix:
                            length = n
                            limit = min(cap, end, i - lo)
                            while length < limit and toks[i - 1 - length] == tail[end - 1 - length]:
                                length += 1
                            if length > best_len:
                                best_pos, best_len = pos, length
                                if length >= cap:
                                    break
                    pos = prev[i]
                if best_len >= 0:
                    return StoreMatch(best_pos, best_len, n, self._doc_at(best_pos).id)
        return None

    def continuation(self, match: StoreMatch, count: int) -> list[int]:
        """Up to ``count`` tokens that followed ``match``, stopping at its document's
        end (``[]`` when the document was dropped since)."""
        if count <= 0:
            return []
        with self._lock:
            base = self._base
            if match.position < base or match.position >= base + len(self._tokens):
                return []
            doc = self._doc_at(match.position)
            if doc.id != match.doc_id:
                return []
            stop = min(match.position + count, doc.end)
            return self._tokens[match.position - base : stop - base]

    def lookup(self, history: Sequence[int], count: int) -> list[int]:
        """Up to ``count`` tokens that followed the longest, then most recent, stored
        occurrence of the end of ``history`` (``[]`` when it never occurred)."""
        with self._lock:
            m = self.match(history)
            return [] if m is None else self.continuation(m, count)

    # -- memory --------------------------------------------------------------------

    def _reset_memory(self) -> None:
        self._tokens: list[int] = []
        self._base = 0  # store position of _tokens[0]
        self._docs: list[_Doc] = []
        self._starts: list[int] = []  # _docs' starts, for bisect
        self._heads: list[dict[int, int]] = [{} for _ in self.levels]
        self._prevs: list[array] = [array("q") for _ in self.levels]

    def _doc_at(self, pos: int) -> _Doc:
        return self._docs[bisect.bisect_right(self._starts, pos) - 1]

    def _append(self, doc_id: int, doc: Sequence[int]) -> None:
        toks = self._tokens
        start = self._base + len(toks)
        toks.extend(doc)
        end = start + len(doc)
        self._docs.append(_Doc(doc_id, start, end))
        self._starts.append(start)
        base = self._base
        for li, n in enumerate(self.levels):
            head = self._heads[li]
            prev = self._prevs[li]
            first = min(start + n, end)
            prev.extend([-1] * (first - start))
            for g in range(first, end):
                i = g - base
                key = hash(tuple(toks[i - n : i]))
                prev.append(head.get(key, -1))
                head[key] = g

    def _trim(self, max_tokens: int) -> None:
        """Drop the oldest documents until at most ``max_tokens`` tokens remain."""
        total = len(self._tokens)
        drop = 0
        while total > max_tokens and drop < len(self._docs):
            total -= self._docs[drop].end - self._docs[drop].start
            drop += 1
        self._drop(drop)

    def _drop(self, k: int) -> None:
        """Forget the ``k`` oldest documents."""
        if k <= 0:
            return
        if k >= len(self._docs):
            self._base += len(self._tokens)
            self._tokens = []
            self._docs, self._starts = [], []
            self._heads = [{} for _ in self.levels]
            self._prevs = [array("q") for _ in self.levels]
            return
        new_base = self._docs[k].start
        cut = new_base - self._base
        del self._tokens[:cut]
        for prev in self._prevs:
            del prev[:cut]
        del self._docs[:k]
        del self._starts[:k]
        self._base = new_base
        # Chains stop at positions below the base; the keys of dropped n-grams stay in
        # the heads until they outnumber the live positions, then the heads are rebuilt
        # (amortised O(1) per dropped token).
        if sum(len(h) for h in self._heads) > 2 * len(self.levels) * len(self._tokens) + 4096:
            docs = self._docs
            b = self._base
            contents = [(d.id, self._tokens[d.start - b : d.end - b]) for d in docs]
            self._reset_memory()
            self._base = b
            for doc_id, doc in contents:
                self._append(doc_id, doc)

    def _apply(self, epoch: int, next_id: int, docs: list[tuple[int, array]]) -> None:
        """Make the in-memory documents those of the file: incrementally when the file
        continues what is held (same epoch; the held documents that remain come first
        in it), else from scratch."""
        ids = [d.id for d in self._docs]
        incremental = False
        keep_from = len(ids)
        if epoch == self._epoch:
            first = docs[0][0] if docs else next_id
            keep_from = bisect.bisect_left(ids, first)
            kept = ids[keep_from:]
            incremental = [i for i, _ in docs[: len(kept)]] == kept
        if incremental:
            self._drop(keep_from)
            for doc_id, doc in docs[len(ids) - keep_from :]:
                self._append(doc_id, doc)
        else:
            self._reset_memory()
            for doc_id, doc in docs:
                self._append(doc_id, doc)
        self._epoch = epoch
        self._next_id = next_id

    # -- the file ------------------------------------------------------------------

    @staticmethod
    def _signature(st: os.stat_result) -> tuple:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def _file_lock(self) -> _FileLock:
        assert self.path is not None
        return _FileLock(self.path + ".lock")

    def _read_file(self) -> tuple[int | None, int, list[tuple[int, array]]]:
        """``(epoch, next_id, [(id, tokens), ...])`` of the file (``epoch`` ``None``:
        no file); records the file's signature."""
        path = self.path
        assert path is not None
        try:
            f = open(path, "rb")  # noqa: SIM115 (fstat of the very file read)
        except FileNotFoundError:
            return None, 0, []
        with f:
            sig = self._signature(os.fstat(f.fileno()))
            data = f.read()
        out = _parse(data, path)
        self._sig = sig
        self.reloads += 1
        return out

    def _write_file(self, epoch: int, next_id: int, docs: list[tuple[int, array]]) -> None:
        path = self.path
        assert path is not None
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        data = _serialise(epoch, next_id, docs)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        # Still under the lock: nobody else can have replaced it since.
        self._sig = self._signature(os.stat(path))


class _FileLock:
    """An exclusive ``fcntl.flock`` on a lock file (created if missing, never removed)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def __enter__(self) -> _FileLock:
        import fcntl

        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def _serialise(epoch: int, next_id: int, docs: list[tuple[int, array]]) -> bytes:
    parts = [_HEADER.pack(MAGIC, FORMAT_VERSION, 0, epoch, next_id, len(docs))]
    for doc_id, toks in docs:
        arr = toks if isinstance(toks, array) and toks.typecode == _U32 else array(_U32, toks)
        if sys.byteorder != "little":  # pragma: no cover
            arr = array(_U32, arr)
            arr.byteswap()
        parts.append(_DOC.pack(doc_id, len(arr)))
        parts.append(arr.tobytes())
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def _parse(data: bytes, path: str) -> tuple[int, int, list[tuple[int, array]]]:
    def bad(why: str) -> CopyStoreError:
        return CopyStoreError(f"ngram copy store {path!r}: {why}")

    if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        raise bad(
            f"not a specdec ngram copy store (it does not start with {MAGIC!r}); "
            "remove it or name another file"
        )
    if len(data) < _HEADER.size + _CRC.size:
        raise bad(f"corrupt: {len(data)} bytes, shorter than a header")
    _, version, _, epoch, next_id, n_docs = _HEADER.unpack_from(data, 0)
    if version != FORMAT_VERSION:
        raise bad(f"format version {version}; this build reads version {FORMAT_VERSION}")
    body = memoryview(data)[: len(data) - _CRC.size]
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(body) != crc:
        raise bad("corrupt: the checksum does not match its contents")
    docs: list[tuple[int, array]] = []
    off = _HEADER.size
    last = -1
    for k in range(n_docs):
        if off + _DOC.size > len(body):
            raise bad(f"corrupt: document {k} of {n_docs} is cut short")
        doc_id, length = _DOC.unpack_from(body, off)
        off += _DOC.size
        if off + 4 * length > len(body):
            raise bad(f"corrupt: document {k} of {n_docs} is cut short")
        if doc_id <= last or doc_id >= next_id:
            raise bad(f"corrupt: document ids out of order ({doc_id} after {last})")
        arr = array(_U32)
        arr.frombytes(body[off : off + 4 * length])
        if sys.byteorder != "little":  # pragma: no cover
            arr.byteswap()
        docs.append((doc_id, arr))
        off += 4 * length
        last = doc_id
    if off != len(body):
        raise bad(f"corrupt: {len(body) - off} bytes after the last document")
    return epoch, next_id, docs
