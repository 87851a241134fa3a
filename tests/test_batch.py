"""Batched speculation: rows of one forward, ragged acceptance, continuous batching."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import SoloOnlyPlugin
from mlx_lm.models.cache import BatchKVCache, KVCache
from specdec.testing import check_batch_identity, copy_heavy_prompt, make_tiny_model, plugin_host


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(llama):
    """Copy-heavy prompts of different lengths (left padding differs per row)."""
    out = [copy_heavy_prompt(llama, [3 + i, 9, 4 + 2 * i, 17], n=12 + 7 * i) for i in range(4)]
    out[1] = out[1][:9]
    return out


# -- the per-row rollback ---------------------------------------------------------------


def _batch_cache(rows: list[list[np.ndarray]]) -> BatchKVCache:
    """A BatchKVCache holding each row's keys (values = keys + 100)."""
    singles = []
    for keys in rows:
        c = KVCache()
        k = mx.array(np.stack(keys)[None, None])  # [1, 1, T, D]
        c.update_and_fetch(k, k + 100)
        singles.append(c)
    return BatchKVCache.merge(singles)


def _valid(c: BatchKVCache, r: int) -> tuple[list, list]:
    lp = int(c.left_padding[r].item())
    k = np.array(c.keys[r, 0, lp : c._idx])
    v = np.array(c.values[r, 0, lp : c._idx])
    return sorted(map(tuple, k.tolist())), sorted(map(tuple, v.tolist()))


@pytest.mark.parametrize("keeps", [[1, 4, 2], [4, 4, 4], [1, 1, 1], [3, 1, 4]])
def test_rows_keep_different_amounts_and_stay_aligned(keeps):
    rng = np.random.default_rng(0)
    lengths = [5, 2, 7]
    rows = [[rng.standard_normal(3).astype(np.float32) for _ in range(n)] for n in lengths]
    cache = _batch_cache(rows)
    fed = 4
    new = [[rng.standard_normal(3).astype(np.float32) for _ in range(fed)] for _ in rows]
    txn = specdec.rollback.BatchKVRollback().begin(cache)
    k = mx.array(np.stack([np.stack(n) for n in new])[:, None])  # [3, 1, fed, 3]
    cache.update_and_fetch(k, k + 100)
    txn.commit(fed, keeps)
    for r, (old, n, keep) in enumerate(zip(rows, new, keeps)):
        want = old + n[:keep]
        # offset = the row's logical length; the valid region holds exactly its entries
        assert int(cache.offset[r].item()) == len(want)
        assert cache._idx - int(cache.left_padding[r].item()) == len(want)
        keys, values = _valid(cache, r)
        assert keys == sorted(tuple(x.tolist()) for x in want)
        assert values == sorted(tuple((x + 100).tolist()) for x in want)


def test_abort_restores_every_row():
    cache = _batch_cache([[np.ones(3, np.float32)] * 3, [np.zeros(3, np.float32)]])
    before = (cache._idx, cache.offset.tolist(), cache.left_padding.tolist())
    txn = specdec.rollback.BatchKVRollback().begin(cache)
    k = mx.ones((2, 1, 5, 3))
    cache.update_and_fetch(k, k)
    txn.abort()
    assert (cache._idx, cache.offset.tolist(), cache.left_padding.tolist()) == before


def test_commit_refuses_a_wrong_number_of_rows():
    cache = _batch_cache([[np.ones(3, np.float32)], [np.ones(3, np.float32)]])
    txn = specdec.rollback.BatchKVRollback().begin(cache)
    cache.update_and_fetch(mx.ones((2, 1, 2, 3)), mx.ones((2, 1, 2, 3)))
    with pytest.raises(ValueError, match="2 rows"):
        txn.commit(2, [1, 1, 1])


# -- rows equal the prompt run alone --------------------------------------------------


def test_copy_rows_equal_each_prompt_alone(llama, prompts):
    out = check_batch_identity(llama, "ngram", prompts, max_tokens=[30, 12, 25, 30])
    assert out["max_batch_rows"] == 4
    assert out["accepted"] > 0 and out["target_forwards"] < out["plain_forwards"]


def test_ragged_acceptance_rows_roll_back_by_different_amounts(llama, prompts):
    # Oracle drafts with about a token in three wrong, drawn per request: the rows
    # reject at different places.
    pol = specdec.Policy(
        name="oracle-batch",
        drafters=("oracle",),
        options={"oracle": {"model": llama, "corruption": 0.3, "block": 5, "seed": 3}},
    )
    out = check_batch_identity(llama, pol, prompts, max_tokens=20)
    assert out["drafted"] > out["accepted"] > 0
    # the rows kept different numbers of entries in some round (a row's snapshot is
    # unordered once a round kept fewer of its entries than of another row's)
    batch = specdec.assemble(llama, None, pol).batch(4)
    for p in prompts:
        batch.add(p, max_tokens=20, keep_cache=True)
    ordered = []
    while len(batch):
        for ev in batch.step():
            if ev.response is not None and ev.response.finish_reason is not None:
                ordered.append(ev.caches[-1].ordered)
    assert len(ordered) == 4 and not all(ordered)


def test_waiting_prompts_join_as_rows_finish(llama, prompts):
    more = [*prompts, prompts[0][:15], prompts[2][3:]]
    out = check_batch_identity(llama, "ngram", more, max_tokens=[8, 20, 5, 14, 9, 16], max_rows=2)
    assert out["max_batch_rows"] == 2


def test_sampled_rows_with_copy_drafts_equal_each_prompt_alone(llama, prompts):
    out = check_batch_identity(llama, "copy", prompts, max_tokens=24, temperature=1.0, seed=7)
    assert out["accepted"] > 0


# -- errors and cancellation ----------------------------------------------------------


class _Fails(specdec.BaseDrafter):
    """Proposes a token, but raises for prompts that start with 63."""

    name = "fails"
    supports_batch = True

    def session(self, ctx):
        return _FailsSession(ctx.prompt_tokens[0] == 63)


class _FailsSession(specdec.BaseDrafterSession):
    def __init__(self, bad):
        self.bad = bad

    def propose(self, history, max_len):
        if self.bad and len(history) > 12:
            raise RuntimeError("drafter broke")
        return specdec.Draft(tokens=[history[-1]])


class _FailsPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("fails", _Fails)


def test_a_row_that_fails_fails_alone(llama, prompts):
    with plugin_host(_FailsPlugin()) as host:
        pipe = specdec.assemble(llama, None, {"drafters": ["fails"]}, host=host)
        plain = specdec.assemble(llama, None, "none", host=host)
        batch = pipe.batch(3)
        bad = [63, 1, 2, 3, 4, 5, 6, 7, 8, 9]
        ids = [batch.add(prompts[0], max_tokens=20), batch.add(bad, max_tokens=20)]
        ids.append(batch.add(prompts[2], max_tokens=20))
        got = {i: [] for i in ids}
        errors = {}
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    errors[ev.row] = ev.error
                elif not ev.response.is_stop_token:
                    got[ev.row].append(ev.response.token)
        assert list(errors) == [ids[1]] and "drafter broke" in str(errors[ids[1]])
        for rid, prompt in ((ids[0], prompts[0]), (ids[2], prompts[2])):
            assert got[rid] == plain.generate(prompt, max_tokens=20).tokens


def test_a_cancelled_row_leaves_at_the_next_round(llama, prompts):
    pipe = specdec.assemble(llama, None, "ngram")
    plain = specdec.assemble(llama, None, "none")
    batch = pipe.batch(2)
    a = batch.add(prompts[0], max_tokens=30)
    b = batch.add(prompts[2], max_tokens=30)
    got = {a: [], b: []}
    rounds = 0
    while len(batch):
        evs = batch.step()
        rounds += 1
        for ev in evs:
            got[ev.row].append(ev.response.token)
        if rounds == 2:
            assert batch.cancel(b)
        if rounds == 3:
            assert batch.running == 1 and all(ev.row == a for ev in evs)
    assert got[a] == plain.generate(prompts[0], max_tokens=30).tokens
    assert not batch.cancel(b)


def test_bad_arguments_and_components_are_refused_before_model_work(llama, prompts):
    pipe = specdec.assemble(llama, None, "ngram")
    with pytest.raises(specdec.RequestError, match="max_tokens"):
        pipe.stream_batch([prompts[0], prompts[1]], max_tokens=0)
    with pytest.raises(specdec.RequestError, match="at least one prompt"):
        pipe.stream_batch([])
    with pytest.raises(specdec.RequestError, match="max_rows"):
        pipe.batch(0)
    with plugin_host(SoloOnlyPlugin()) as host:
        solo = specdec.assemble(llama, None, {"drafters": ["solo_only"]}, host=host)
        with pytest.raises(specdec.PolicyError, match="solo_only.*does not support batched rows"):
            solo.batch(2)


def test_rows_can_start_from_a_prompt_cache(llama, prompts):
    from mlx_lm.models.cache import make_prompt_cache

    ids = prompts[2]
    cache = make_prompt_cache(llama)
    llama(mx.array(ids[:-1])[None], cache=cache)
    before = [np.array(c.keys[..., : c.offset, :]) for c in cache]
    pipe = specdec.assemble(llama, None, "ngram")
    want = specdec.assemble(llama, None, "none").generate(ids, max_tokens=20).tokens
    batch = pipe.batch(3)
    for _ in range(3):
        batch.add(ids, prompt_cache=cache, max_tokens=20)
    got: dict = {}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            got.setdefault(ev.row, []).append(ev.response.token)
    assert list(got.values()) == [want] * 3
    # the given cache is copied, never written
    assert all(c.offset == len(ids) - 1 for c in cache)
    for b, c in zip(before, cache):
        assert np.array_equal(b, np.array(c.keys[..., : c.offset, :]))
    with pytest.raises(
        specdec.RequestError, match=f"prompt_cache holds {len(ids) - 1} tokens; the prompt has"
    ):
        batch.add(ids[:-2], prompt_cache=cache)
    with pytest.raises(specdec.RequestError, match="per-layer caches"):
        batch.add(ids, prompt_cache=cache[:1])


def test_rows_can_start_from_a_cache_holding_a_prefix(llama, prompts):
    from mlx_lm.models.cache import make_prompt_cache

    ids = prompts[2]
    cache = make_prompt_cache(llama)
    llama(mx.array(ids[:5])[None], cache=cache)  # a shared prefix (a system prompt)
    before = [np.array(c.keys[..., : c.offset, :]) for c in cache]
    pipe = specdec.assemble(llama, None, "ngram")
    plain = specdec.assemble(llama, None, "none")
    batch = pipe.batch(2)
    longer = ids + ids[:6]
    rows = {batch.add(p, prompt_cache=cache, max_tokens=20): p for p in (ids, longer)}
    got: dict = {}
    stats = {}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            if not ev.response.is_stop_token:
                got.setdefault(ev.row, []).append(ev.response.token)
            if ev.response.stats is not None:
                stats[ev.row] = ev.response.stats
    for rid, p in rows.items():
        assert got[rid] == plain.generate(p, max_tokens=20).tokens
        assert stats[rid].cached_tokens == 5
    # the given cache is copied, never written
    assert all(c.offset == 5 for c in cache)
    for b, c in zip(before, cache):
        assert np.array_equal(b, np.array(c.keys[..., : c.offset, :]))


def test_a_request_that_fails_to_join_leaves_the_running_rows_intact(llama, prompts, monkeypatch):
    import specdec.batch as batch_module

    pipe = specdec.assemble(llama, None, "ngram")
    plain = specdec.assemble(llama, None, "none")
    batch = pipe.batch(3)
    a = batch.add(prompts[0], max_tokens=20)
    b = batch.add(prompts[2], max_tokens=20)
    got = {a: [], b: []}
    for ev in batch.step():
        got[ev.row].append(ev.response.token)
    real = batch_module._merged

    def broken(caches):
        out = real(caches)
        out[1] = object()  # layer 1 cannot be appended: layer 0 already was
        return out

    monkeypatch.setattr(batch_module, "_merged", broken)
    c = batch.add(prompts[3], max_tokens=5)
    errors = []
    for ev in batch.step():
        if ev.error is not None:
            errors.append(ev.row)
        else:
            got[ev.row].append(ev.response.token)
    assert errors == [c] and batch.running == 2
    monkeypatch.undo()
    while len(batch):
        for ev in batch.step():
            got[ev.row].append(ev.response.token)
    assert got[a] == plain.generate(prompts[0], max_tokens=20).tokens
    assert got[b] == plain.generate(prompts[2], max_tokens=20).tokens


def test_rows_hand_back_their_caches_for_reuse(llama, prompts):
    """keep_cache: the prompt's caches on a row's first event, the whole request's on its
    last; continued from either, a longer prompt decodes as it does from scratch, also
    from a row whose entries a ragged rollback reordered (used whole, not trimmed)."""
    import copy

    batch = specdec.assemble(llama, None, "ngram").batch(4)
    plain = specdec.assemble(llama, None, "none")
    rows = {batch.add(p, max_tokens=20, keep_cache=True): p for p in prompts}
    snaps: dict = {rid: [] for rid in rows}
    out: dict = {rid: [] for rid in rows}
    accepted = 0
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            snaps[ev.row].extend(ev.caches)
            out[ev.row].append(ev.response.token)
            if ev.response.stats is not None:
                accepted += ev.response.stats.accepted
    assert accepted > 0
    unordered = 0
    for rid, p in rows.items():
        first, last = snaps[rid]
        assert first.ordered and first.tokens == tuple(p[:-1])
        assert all(c.offset == len(p) - 1 for c in first.caches)
        # the whole request: the prompt, then what it committed (at most all it emitted)
        assert last.tokens == tuple([*p, *out[rid]][: len(last.tokens)])
        assert len(last.tokens) >= len(p) + len(out[rid]) - 1
        unordered += not last.ordered
        more = [*last.tokens, *p[:7]]
        want = plain.generate(more, max_tokens=12).tokens
        got = plain.generate(more, max_tokens=12, prompt_cache=copy.deepcopy(last.caches))
        assert got.tokens == want and got.stats.cached_tokens == len(last.tokens)
        # the prompt's caches, trimmed to a shorter prefix, serve another prompt
        fork = [*p[:-3], *p[:4]]
        cache = copy.deepcopy(first.caches)
        for c in cache:
            c.trim(2)
        assert plain.generate(fork, max_tokens=8, prompt_cache=cache).tokens == (
            plain.generate(fork, max_tokens=8).tokens
        )
    assert unordered > 0  # rows that drafted while another did not keep fewer entries
    with pytest.raises(specdec.RequestError, match="keep_cache must be True or False"):
        batch.add(prompts[0], keep_cache=1)


def test_a_row_started_from_an_unordered_snapshot_hands_back_unordered_ones(llama, prompts):
    """Entries a ragged rollback moved stay where they are in a row that starts from
    them: its snapshots must not claim position order (a trim would cut the wrong ones)."""
    batch = specdec.assemble(llama, None, "ngram").batch(4)
    for p in prompts:
        batch.add(p, max_tokens=20, keep_cache=True)
    final = []
    while len(batch):
        for ev in batch.step():
            if ev.response is not None and ev.response.finish_reason is not None:
                final.append(ev.caches[-1])
    unordered = next(s for s in final if not s.ordered)
    more = [*unordered.tokens, *prompts[0][:6]]
    with pytest.raises(specdec.RequestError, match="not the prompt's first tokens"):
        batch.add([7, *more[1:]], prompt_cache=unordered)
    plain = specdec.assemble(llama, None, "none").batch(1)
    rid = plain.add(more, prompt_cache=unordered, max_tokens=8, keep_cache=True)
    snaps, out = [], []
    while len(plain):
        for ev in plain.step():
            assert ev.error is None and ev.row == rid
            snaps.extend(ev.caches)
            out.append(ev.response.token)
    assert len(snaps) == 2 and not any(s.ordered for s in snaps)
    want = specdec.assemble(llama, None, "none").generate(more, max_tokens=8)
    assert out[: len(want.tokens)] == want.tokens  # (and then a stop token, if one ended it)
