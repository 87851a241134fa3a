"""The cross-request store (``CopyStore``) and ``ngram_copy``'s ``store`` option."""

from __future__ import annotations

import functools
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import specdec
from specdec.testing import check_greedy_identity, feed_round, make_tiny_model, request_context
from specdec_ngram import DEFAULTS, CopyStore, CopyStoreError, create_ngram_copy
from specdec_ngram import store as store_module

STORE_PY = Path(store_module.__file__)


def reference(docs, history, count, min_n, max_extend):
    """Brute force: the continuation of the longest, then most recent, occurrence of
    the end of ``history`` in ``docs`` (oldest first), never across a boundary."""
    best, best_len = None, -1
    for doc in docs:
        for p in range(1, len(doc)):  # the copy starts at doc[p]: one token at least
            n = 0
            while (
                n < max_extend and n < p and n < len(history) and doc[p - 1 - n] == history[-1 - n]
            ):
                n += 1
            if n >= min_n and n >= best_len:  # >=: a later one is more recent
                best, best_len = (doc, p), n
    if best is None:
        return [], 0
    doc, p = best
    return doc[p : p + count], best_len


# -- lookup ------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(40):
        alphabet = rng.randint(2, 4)
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 6)
        max_extend = rng.choice([max_n, 7, 64])
        store = CopyStore(min_n=min_n, max_n=max_n, max_candidates=10**6, max_extend=max_extend)
        docs = [
            [rng.randrange(alphabet) for _ in range(rng.randint(0, 40))]
            for _ in range(rng.randint(1, 6))
        ]
        for d in docs:
            store.add(d)
        docs = [d for d in docs if d]
        assert store.documents() == docs and store.n_documents == len(docs)
        assert store.n_tokens == sum(map(len, docs))
        for _ in range(25):
            history = [rng.randrange(alphabet) for _ in range(rng.randint(0, 14))]
            count = rng.randint(1, 8)
            expected, length = reference(docs, history, count, min_n, max(max_extend, max_n))
            assert store.lookup(history, count) == expected, (docs, history, min_n, max_n)
            m = store.match(history)
            assert (m.length if m else 0) == length


def test_longest_then_most_recent():
    store = CopyStore(min_n=2, max_n=4)
    store.add([9, 1, 2, 30, 31])
    store.add([8, 1, 2, 40, 41])
    store.add([7, 1, 2, 50, 51])
    assert store.lookup([6, 1, 2], 2) == [50, 51]  # all match two tokens: most recent
    assert store.lookup([6, 9, 1, 2], 2) == [30, 31]  # a longer match wins
    assert store.lookup([6, 1, 2], 0) == [] and store.lookup([1], 3) == []


def test_no_match_across_document_boundaries():
    store = CopyStore(min_n=2, max_n=4)
    store.add([1, 2, 3])
    store.add([4, 5, 6, 7, 8])
    assert store.lookup([0, 3, 4], 3) == []  # "3 4" only spans the boundary
    assert store.lookup([0, 2, 3], 3) == []  # "2 3" ends a document: nothing follows
    # the backwards extension stops at the start of the document
    m = store.match([1, 2, 3, 4, 5])
    assert m is not None and m.length == 2 and store.continuation(m, 10) == [6, 7, 8]
    # and a copy stops at the end of its document
    store.add([6, 7, 99])
    assert store.lookup([4, 5], 10) == [6, 7, 8]


def test_bound_drops_the_oldest_documents():
    store = CopyStore(max_tokens=10, min_n=2, max_n=3)
    for k in range(5):
        store.add([100 * k + i for i in range(4)])
    assert store.documents() == [[300, 301, 302, 303], [400, 401, 402, 403]]
    assert store.n_tokens == 8 <= store.max_tokens
    assert store.lookup([100, 101], 2) == []  # dropped
    assert store.lookup([300, 301], 2) == [302, 303]
    store.add(list(range(1000, 1015)))  # longer than the bound: its first 10 tokens
    assert store.documents() == [list(range(1000, 1010))]
    assert store.lookup([1007, 1008], 5) == [1009]


def test_many_trims_keep_the_index_right_and_bounded():
    rng = random.Random(7)
    store = CopyStore(max_tokens=300, min_n=2, max_n=4, max_candidates=10**6)
    for _ in range(400):
        store.add([rng.randrange(3) for _ in range(rng.randint(1, 30))])
        assert store.n_tokens <= 300
    docs = store.documents()
    assert sum(len(h) for h in store._heads) <= 2 * 2 * store.n_tokens + 4096
    for _ in range(50):
        history = [rng.randrange(3) for _ in range(rng.randint(1, 10))]
        assert store.lookup(history, 5) == reference(docs, history, 5, 2, 64)[0]


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        CopyStore(max_tokens=0)
    with pytest.raises(ValueError, match="min_n"):
        CopyStore(min_n=5, max_n=3)
    with pytest.raises(ValueError, match="integers"):
        CopyStore().add([1, -2])


# -- on disk -------------------------------------------------------------------------------


def test_disk_round_trip_and_refresh(tmp_path):
    path = tmp_path / "sub" / "store.bin"
    a = CopyStore(path, min_n=2, max_n=4)
    assert a.n_documents == 0 and not path.exists()  # nothing written until an add
    a.add([1, 2, 3, 4])
    a.add([5, 6, 7, 8, 2**32 - 1])
    assert path.read_bytes()[:8] == b"SDNGSTOR"
    b = CopyStore(path, min_n=2, max_n=4)
    assert b.documents() == a.documents() == [[1, 2, 3, 4], [5, 6, 7, 8, 2**32 - 1]]
    assert b.lookup([0, 6, 7], 5) == [8, 2**32 - 1]
    assert b.refresh() is False  # unchanged
    a.add([9, 10, 11])
    assert b.lookup([9, 10], 1) == []  # not seen until refreshed
    reloads = b.reloads
    assert b.refresh() is True and b.reloads == reloads + 1
    assert b.lookup([9, 10], 1) == [11] and b.document_ids() == a.document_ids() == [0, 1, 2]
    b.clear()
    assert a.refresh() is True and a.n_documents == 0
    path.unlink()
    b.add([1, 2, 3])
    assert a.refresh() is True and a.documents() == [[1, 2, 3]]


def test_disk_bound_and_incremental_reload(tmp_path):
    path = tmp_path / "s.bin"
    writer = CopyStore(path, max_tokens=12)
    reader = CopyStore(path, max_tokens=12)
    for k in range(10):
        writer.add([k] * 5 + [50 + k])
        assert reader.refresh() is True
        assert reader.documents() == writer.documents()
        assert reader.n_tokens <= 12
    assert writer.document_ids() == [8, 9]
    assert reader.lookup([8, 8, 8], 3) == [58] and reader.lookup([7, 7], 3) == []


WORKER = textwrap.dedent(
    """
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("copy_store", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    store = mod.CopyStore(sys.argv[2], max_tokens=10**7)
    tag, n = int(sys.argv[3]), int(sys.argv[4])
    for i in range(n):
        store.add([tag, i, tag * 1000 + i])
    """
)


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "shared.bin"
    n, writers = 150, 3
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(STORE_PY), str(path), str(t), str(n)])
        for t in range(1, writers + 1)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0
    store = CopyStore(path)
    docs = store.documents()
    assert len(docs) == n * writers
    assert sorted(map(tuple, docs)) == sorted(
        (t, i, t * 1000 + i) for t in range(1, writers + 1) for i in range(n)
    )
    assert store.document_ids() == list(range(n * writers))
    # each writer's documents are in the order it added them
    for t in range(1, writers + 1):
        assert [d[1] for d in docs if d[0] == t] == list(range(n))
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_corrupt_or_foreign_files_are_clear_errors(tmp_path):
    path = tmp_path / "store.bin"
    path.write_text('{"not": "a store"}')
    with pytest.raises(CopyStoreError, match="not a specdec ngram copy store") as exc:
        CopyStore(path)
    assert str(path) in str(exc.value)
    CopyStore(tmp_path / "good.bin").add([1, 2, 3, 4])
    good = (tmp_path / "good.bin").read_bytes()
    flipped = bytearray(good)
    flipped[-6] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(CopyStoreError, match="checksum"):
        CopyStore(path)
    path.write_bytes(good[:20])
    with pytest.raises(CopyStoreError, match="corrupt"):
        CopyStore(path)
    newer = bytearray(good)
    struct.pack_into("<I", newer, 8, 99)
    path.write_bytes(bytes(newer))
    with pytest.raises(CopyStoreError, match="version 99"):
        CopyStore(path)
    # a store that is already open reports it at the next refresh, not a silent reset
    ok = tmp_path / "ok.bin"
    s = CopyStore(ok)
    s.add([1, 2, 3])
    ok.write_bytes(b"garbage!" * 4)
    with pytest.raises(CopyStoreError, match=str(ok)):
        s.refresh()
    with pytest.raises(CopyStoreError):
        s.add([4, 5, 6])
    assert ok.read_bytes() == b"garbage!" * 4  # left as it was
    # through the drafter: a PolicyError naming the file
    with pytest.raises(specdec.PolicyError, match="store.*not a specdec ngram copy store"):
        create_ngram_copy(store=str(ok))


# -- the drafter's options ----------------------------------------------------------------


def test_store_options():
    assert DEFAULTS["store"] is False and DEFAULTS["store_max_tokens"] == 200_000
    assert create_ngram_copy().store is None
    d = create_ngram_copy(store=True, store_max_tokens=50, min_n=3, max_n=6)
    assert d.store is not None and d.store.path is None
    assert (d.store.max_tokens, d.store.min_n, d.store.max_n) == (50, 3, 6)
    assert create_ngram_copy(store=True).store is not create_ngram_copy(store=True).store


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({"store": 1}, "store must be true, false or a file path"),
        ({"store": ""}, "store must be"),
        ({"store": ["a"]}, "store must be"),
        ({"store_max_tokens": 0}, "store_max_tokens"),
        ({"store_max_tokens": True}, "store_max_tokens"),
    ],
)
def test_bad_store_options(options, fragment):
    with pytest.raises(specdec.PolicyError, match=fragment):
        create_ngram_copy(**options)


# -- sessions (no model) --------------------------------------------------------------------


ANSWER = list(range(100, 140))


def test_a_session_copies_an_earlier_requests_output():
    drafter = create_ngram_copy(store=True, sizing="ladder")
    first = drafter.session(request_context([1, 2, 3]))
    feed_round(first, [1, 2, 3], ANSWER)
    first.end()
    assert drafter.store.documents() == [ANSWER]  # the output, not the prompt
    second = drafter.session(request_context([4, 5, 6]))  # the answer is not in this context
    h = feed_round(second, [4, 5, 6], ANSWER[:4])
    draft = second.propose(h, 16)
    assert draft is not None and draft.tokens == tuple(ANSWER[4:12])  # ladder: 4 -> 8
    h = feed_round(second, h, ANSWER[4:12], block=draft.tokens, n_accepted=8, drafter="ngram_copy")
    st = second.stats()
    assert (st["store_hits"], st["store_proposed_tokens"], st["store_accepted_tokens"]) == (1, 8, 8)
    assert st["hits"] == 1 and st["store"] is True
    assert (st["store_tokens"], st["store_documents"]) == (len(ANSWER), 1)
    assert st["estimates"]["store"]["outcomes"] > 0
    # a match in the context comes first
    h = feed_round(second, h, [4, 5])
    assert second.propose(h, 16).tokens[:1] == (6,)
    assert second.stats()["store_hits"] == 1
    second.end()
    assert drafter.store.n_documents == 2
    drafter.reset()
    assert drafter.store.n_documents == 0


def test_without_a_store_nothing_is_kept():
    drafter = create_ngram_copy()
    s = drafter.session(request_context([1, 2, 3]))
    feed_round(s, [1, 2, 3], ANSWER)
    s.end()
    other = drafter.session(request_context([4, 5, 6]))
    h = feed_round(other, [4, 5, 6], ANSWER[:4])
    assert other.propose(h, 16) is None
    st = other.stats()
    assert st["store"] is False and st["store_hits"] == 0 and st["store_tokens"] == 0


def test_store_hits_are_sized_by_the_cost(tmp_path):
    curve = specdec.costs.VerifyCostCurve(
        widths=(1, 2, 4, 8, 17), contexts=(1,), seconds=((1.0, 1.0, 1.0, 1.0, 1.0),)
    )
    drafter = create_ngram_copy(store=str(tmp_path / "s.bin"))
    first = drafter.session(request_context([1, 2, 3]))
    feed_round(first, [1, 2, 3], ANSWER)
    first.end()
    # another pipeline (or process) naming the same file sees it
    other = create_ngram_copy(store=str(tmp_path / "s.bin"))
    c = request_context([4, 5, 6])
    c.cost = specdec.costs.CostModel(None, curve=curve)
    s = other.session(c)
    h = feed_round(s, [4, 5, 6], ANSWER[:3])
    draft = s.propose(h, 16)
    assert draft is not None and draft.tokens == tuple(ANSWER[3:19])  # a free verify: all 16
    assert s.stats()["sizing_used"] == "cost" and s.stats()["store_hits"] == 1


def test_a_store_that_cannot_be_written_warns(tmp_path):
    path = tmp_path / "s.bin"
    drafter = create_ngram_copy(store=str(path))
    s = drafter.session(request_context([1, 2, 3]))
    feed_round(s, [1, 2, 3], ANSWER)
    path.write_bytes(b"not a store")
    with pytest.warns(RuntimeWarning, match="not stored"):
        s.end()


# -- in the pipeline, on a tiny random model ------------------------------------------------

# round_overhead off: on a tiny model a forward costs about the loop's host work, and
# with the measured round overhead which blocks pay would depend on the machine's
# timing (a fresh-clone CI run once accepted 5 store tokens here, not 8).
STORE = specdec.Policy(
    name="ngram-store",
    drafters=("ngram_copy",),
    options={"ngram_copy": {"store": True, "round_overhead": False}},
)


@functools.cache
def _repeating(arch, vocab, min_accepted=8):
    """A prompt whose greedy output, asked for twice, is copied from the store the second
    time (the search over seeds is deterministic)."""
    model = make_tiny_model(arch, vocab_size=vocab, seed=0)
    tried = []
    for s in range(16):
        prompt = random.Random(s).sample(range(vocab), 10)
        pipe = specdec.assemble(model, policy=STORE)
        pipe.generate(prompt, max_tokens=32)
        st = pipe.generate(prompt, max_tokens=32).stats.per_drafter["ngram_copy"]
        if st["store_accepted_tokens"] >= min_accepted:
            return tuple(prompt)
        tried.append(st["store_accepted_tokens"])
    raise AssertionError(f"no prompt copied from the store for tiny {arch}: {tried}")


@pytest.mark.parametrize("arch, vocab", [("llama", 64), ("qwen3", 64)])
def test_pipeline_copies_from_the_store_and_stays_greedy_identical(arch, vocab):
    model = make_tiny_model(arch, vocab_size=vocab, seed=0)
    prompt = list(_repeating(arch, vocab))
    plain = specdec.assemble(model, policy="none")
    pipe = specdec.assemble(model, policy=STORE)
    expected = plain.generate(prompt, max_tokens=32).tokens
    first = pipe.generate(prompt, max_tokens=32)
    assert first.tokens == expected
    assert first.stats.per_drafter["ngram_copy"]["store_hits"] == 0  # nothing stored yet
    second = pipe.generate(prompt, max_tokens=32)
    assert second.tokens == expected
    st = second.stats.per_drafter["ngram_copy"]
    assert st["store_hits"] > 0 and st["store_proposed_tokens"] > 0
    assert st["store_accepted_tokens"] >= 8
    assert st["store_documents"] == 1 and st["store_tokens"] >= len(expected)
    assert second.stats.target_forwards < first.stats.target_forwards
    # another request in between, and every max_tokens, on one pipeline sharing a store
    pipe.generate([(t + 1) % vocab for t in prompt], max_tokens=16)
    totals = check_greedy_identity(model, STORE, prompt, max_tokens_list=(1, 2, 5, 16, 32))
    assert totals["accepted"] > 0


def test_pipelines_share_a_store_file(tmp_path):
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = list(_repeating("llama", 64))
    pol = STORE.with_options("ngram_copy", store=str(tmp_path / "store.bin"))
    expected = specdec.assemble(model, policy="none").generate(prompt, max_tokens=32).tokens
    a = specdec.assemble(model, policy=pol)
    b = specdec.assemble(model, policy=pol)
    assert a.generate(prompt, max_tokens=32).tokens == expected
    out = b.generate(prompt, max_tokens=32)  # b reloads the file a wrote
    assert out.tokens == expected
    assert out.stats.per_drafter["ngram_copy"]["store_accepted_tokens"] >= 8
    assert os.path.exists(str(tmp_path / "store.bin.lock"))
