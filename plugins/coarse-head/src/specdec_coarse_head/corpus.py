"""Token frequencies for the pruned coarse head: which rows of the output layer to keep.

The built-in corpus is text every Python installation carries: the language
reference topics of ``pydoc_data`` (English prose) and the source of a few
standard-library modules (code). None of it is a ``specdec bench`` workload.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np

#: Standard-library modules whose source is the code part of the built-in corpus.
CODE_MODULES = (
    "argparse",
    "asyncio.base_events",
    "bisect",
    "calendar",
    "collections",
    "configparser",
    "contextlib",
    "csv",
    "ctypes",
    "dataclasses",
    "datetime",
    "difflib",
    "email.message",
    "enum",
    "fractions",
    "ftplib",
    "functools",
    "getopt",
    "gettext",
    "heapq",
    "html.parser",
    "http.client",
    "http.server",
    "json.decoder",
    "json.encoder",
    "locale",
    "logging",
    "optparse",
    "pathlib",
    "pprint",
    "random",
    "shlex",
    "shutil",
    "smtplib",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "tempfile",
    "textwrap",
    "typing",
    "unittest.case",
    "urllib.parse",
    "urllib.request",
    "uuid",
    "webbrowser",
    "xml.dom.minidom",
    "zipfile",
)


def builtin_texts() -> list[str]:
    """The built-in corpus as texts (what this Python has of it)."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics

        texts += [topics[k] for k in sorted(topics)]
    except ImportError:  # pragma: no cover - a Python without pydoc_data
        pass
    for name in CODE_MODULES:
        try:
            texts.append(inspect.getsource(importlib.import_module(name)))
        except (ImportError, OSError, TypeError):  # pragma: no cover - stripped installs
            continue
    return texts


def corpus_files(spec: str) -> list[str]:
    """The files of a corpus given as a path: the file itself, or every ``.txt``, ``.md``
    and ``.py`` file under the folder (sorted)."""
    path = os.path.abspath(os.path.expanduser(spec))
    if os.path.isfile(path):
        return [path]
    return sorted(
        os.path.join(r, f)
        for r, _d, fs in os.walk(path)
        for f in fs
        if f.endswith((".txt", ".md", ".py"))
    )


def read_corpus(spec: str) -> list[str]:
    """The texts of ``spec``: ``"builtin"``, a text file, or a folder (every ``.txt``,
    ``.md`` and ``.py`` file in it, recursively)."""
    if spec == "builtin":
        return builtin_texts()
    out = []
    for fn in corpus_files(spec):
        with open(fn, encoding="utf-8", errors="replace") as f:
            out.append(f.read())
    if not any(t.strip() for t in out):
        import specdec

        raise specdec.PolicyError(
            f"coarse_head: option corpus: {spec!r} holds no text (a text file, or a folder "
            "with .txt, .md or .py files, is needed)"
        )
    return out


#: Bumped when the ranking rule or the built-in corpus changes.
_FORMAT = 1


def _vocab_digest(tokenizer: Any, vocab_size: int) -> str | None:
    """A digest of the tokenizer's vocabulary (``None`` when it cannot list it)."""
    raw = getattr(tokenizer, "_tokenizer", tokenizer)
    get_vocab = getattr(raw, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:
        return None
    h = hashlib.sha256(str(vocab_size).encode())
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _corpus_digest(spec: str) -> str:
    """What identifies the corpus: the built-in's modules and Python version, or each
    file's path, size and modification time."""
    h = hashlib.sha256(f"{_FORMAT}|{spec}".encode())
    if spec == "builtin":
        h.update(f"{sys.version_info[:2]}|{','.join(CODE_MODULES)}".encode())
        return h.hexdigest()
    path = os.path.abspath(os.path.expanduser(spec))
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(r, f)
            for r, _d, fs in os.walk(path)
            for f in fs
            if f.endswith((".txt", ".md", ".py"))
        )
    )
    for f in files:
        st = os.stat(f)
        h.update(f"{f}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def cached_frequent_tokens(
    tokenizer: Any, corpus: str, vocab_size: int, keep: int, folder: Any
) -> tuple[np.ndarray, dict]:
    """:func:`frequent_tokens` over :func:`read_corpus` ``(corpus)``, kept in ``folder``
    (one small JSON file per tokenizer, corpus and ``keep``; written atomically) so a
    second build does not tokenize the corpus again. ``info["cached"]`` says which."""
    vocab = _vocab_digest(tokenizer, vocab_size)
    path = None
    if vocab is not None and folder is not None:
        key = hashlib.sha256(f"{vocab}|{_corpus_digest(corpus)}|{keep}".encode()).hexdigest()
        path = os.path.join(os.fspath(folder), f"frequent-{key[:32]}.json")
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            ids = np.array(doc["ids"], dtype=np.int32)
            if len(ids) and int(ids.max()) < vocab_size:
                return ids, {**doc["info"], "cached": path}
        except (OSError, ValueError, KeyError, TypeError):
            pass
    ids, info = frequent_tokens(tokenizer, read_corpus(corpus), vocab_size, keep)
    if path is not None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"ids": ids.tolist(), "info": info}, f)
            os.replace(tmp, path)
        except OSError:  # a read-only cache: rank again next time
            pass
    return ids, {**info, "cached": False}


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:
        return list(tokenizer.encode(text))


def frequent_tokens(
    tokenizer: Any, texts: Iterable[str], vocab_size: int, keep: int, chunk_chars: int = 4000
) -> tuple[np.ndarray, dict]:
    """The ``keep`` token ids to keep: the corpus's most frequent (ties: lower id), the
    tokenizer's end-of-sequence ids, then the lowest ids not taken yet (byte-pair
    vocabularies number tokens roughly in merge order, common ones first).

    Returns ``(ids sorted ascending, info)``; ``info`` says how many came from where.
    """
    counts: Counter = Counter()
    n_tokens = 0
    if tokenizer is not None:
        for text in texts:
            for i in range(0, len(text), chunk_chars):
                ids = _encode(tokenizer, text[i : i + chunk_chars])
                counts.update(t for t in ids if 0 <= t < vocab_size)
                n_tokens += len(ids)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:keep]
    chosen = set(ranked)
    eos = set()
    if tokenizer is not None:
        raw = getattr(tokenizer, "eos_token_ids", None)
        if raw is None:
            raw = [getattr(tokenizer, "eos_token_id", None)]
        eos = {int(t) for t in raw if t is not None and 0 <= int(t) < vocab_size}
    chosen |= eos
    from_corpus = len(ranked)
    fill = 0
    t = 0
    while len(chosen) < keep and t < vocab_size:
        if t not in chosen:
            chosen.add(t)
            fill += 1
        t += 1
    ids = np.array(sorted(chosen), dtype=np.int32)
    info = {
        "corpus_tokens": n_tokens,
        "corpus_distinct": len(counts),
        "from_corpus": from_corpus,
        "eos": len(eos),
        "lowest_ids": fill,
    }
    return ids, info


#: Word-start markers of byte-level BPE (GPT-2's "Ġ") and SentencePiece ("▁").
_MARKERS = ("\u0120", "\u2581", " ")


def variant_groups(
    tokenizer: Any, vocab_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Tokens that spell the same word up to case and a leading word-start marker
    (``Git``, `` Git``, ``git``, `` GIT``): ``(group_of [V], members sorted by group,
    start of each group in members [G + 1])``, or ``None`` when the tokenizer cannot
    list its tokens."""
    raw = getattr(tokenizer, "_tokenizer", tokenizer)
    convert = getattr(raw, "convert_ids_to_tokens", None)
    if convert is None:
        return None
    n = vocab_size
    get_vocab = getattr(raw, "get_vocab", None)
    if get_vocab is not None:
        try:  # an output layer may have more rows than the tokenizer has tokens
            n = min(n, max(get_vocab().values()) + 1)
        except Exception:
            pass
    try:
        names = list(convert(list(range(n)))) + [None] * (vocab_size - n)
    except Exception:  # an odd tokenizer: no variants
        return None
    keys: dict[str, int] = {}
    group_of = np.empty(vocab_size, dtype=np.int64)
    for i, name in enumerate(names):
        if not isinstance(name, str):  # a row the tokenizer has no token for: alone
            group_of[i] = keys.setdefault(f"\0{i}", len(keys))
            continue
        k = name
        while k[:1] in _MARKERS and len(k) > 1:
            k = k[1:]
        group_of[i] = keys.setdefault(k.lower(), len(keys))
    members = np.argsort(group_of, kind="stable").astype(np.int64)
    starts = np.searchsorted(group_of[members], np.arange(len(keys) + 1))
    return group_of, members, starts


def with_variants(ids: np.ndarray, groups: tuple | None) -> np.ndarray:
    """``ids`` and every token of their variant groups (unique, ascending)."""
    if groups is None or not ids.size:
        return ids
    group_of, members, starts = groups
    gs = np.unique(group_of[ids])
    parts = [members[starts[g] : starts[g + 1]] for g in gs]
    return np.unique(np.concatenate([ids, *parts]))
