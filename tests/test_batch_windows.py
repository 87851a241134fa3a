"""Sliding-window layers in a batch: the per-row rollback of ``BatchRotatingKVCache``
and speculative rows of tiny Gemma 3 / Gemma 4 models past their window."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import OneAmountPlugin
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache
from specdec.rollback import BatchRotatingRollback, order_for_block
from specdec.testing import check_batch_identity, copy_heavy_prompt, make_tiny_model, plugin_host

W = 8  # the window of the unit tests' caches (and of the tiny gemma models)
D = 3


def _keys(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [rng.standard_normal(D).astype(np.float32) for _ in range(n)]


def _batch(rows: list[list[np.ndarray]]) -> BatchRotatingKVCache:
    """Each row's keys fed to its own RotatingKVCache in one update, merged (values =
    keys + 100)."""
    singles = []
    for keys in rows:
        c = RotatingKVCache(max_size=W, keep=0)
        k = mx.array(np.stack(keys)[None, None])
        c.update_and_fetch(k, k + 100)
        singles.append(c)
    return BatchRotatingKVCache.merge(singles)


def _feed(cache: BatchRotatingKVCache, new: list[list[np.ndarray]]) -> None:
    k = mx.array(np.stack([np.stack(n) for n in new])[:, None])  # [B, 1, n, D]
    cache.update_and_fetch(k, k + 100)


def _check(cache: BatchRotatingKVCache, history: list[list[np.ndarray]]) -> None:
    """Every row's valid entries, in temporal order, are the last entries of its history,
    at least its last W - 1 (what its next query may attend to), keys and values, and
    its offset is its history's length."""
    keys, values = cache.keys, cache.values
    if cache.rotated:
        keys = mx.roll(keys, -cache._idx, axis=2)
        values = mx.roll(values, -cache._idx, axis=2)
    else:
        keys, values = keys[..., : cache._idx, :], values[..., : cache._idx, :]
    for r, h in enumerate(history):
        assert int(cache.offset[r].item()) == len(h), f"row {r}: offset"
        lp = max(int(cache.left_padding[r].item()), 0)
        k = np.array(keys[r, 0, lp:])
        v = np.array(values[r, 0, lp:])
        need = min(W - 1, len(h))
        assert need <= k.shape[0] <= len(h), f"row {r}: {k.shape[0]} valid entries"
        want = np.stack(h[len(h) - k.shape[0] :])  # nothing else counts as valid
        np.testing.assert_array_equal(k, want, err_msg=f"row {r}: keys")
        np.testing.assert_array_equal(v, want + 100, err_msg=f"row {r}: values")


@pytest.mark.parametrize("steps", [0, 2, 9], ids=["concat", "steps", "wrapped"])
@pytest.mark.parametrize("keeps", [[1, 4, 2], [4, 4, 4], [1, 1, 1], [0, 3, 4]])
def test_rows_keep_different_amounts_after_the_window_wrapped(keeps, steps):
    """Rows shorter than, as long as and longer than the window (left padding above and
    below 0), one-token steps first (the ring wraps), then a 4-token verify: each row
    keeps its own count, and later one-token and multi-token updates see exactly the
    kept entries."""
    rng = np.random.default_rng(steps)
    rows = [_keys(rng, n) for n in (3, W, 13)]
    cache = _batch(rows)
    history = [list(r) for r in rows]
    for _ in range(steps):  # plain rounds: one token per row, written in place
        new = [_keys(rng, 1) for _ in rows]
        _feed(cache, new)
        for h, n in zip(history, new):
            h.extend(n)
    _check(cache, history)
    fed = 4
    order_for_block([cache], fed)
    txn = BatchRotatingRollback().begin(cache)
    new = [_keys(rng, fed) for _ in rows]
    _feed(cache, new)
    txn.commit(fed, keeps)
    for h, n, k in zip(history, new, keeps):
        h.extend(n[:k])
    _check(cache, history)
    for width in (1, 1, 3, 1):  # the next rounds keep everything they feed
        order_for_block([cache], width)
        new = [_keys(rng, width) for _ in rows]
        _feed(cache, new)
        for h, n in zip(history, new):
            h.extend(n)
        _check(cache, history)


def test_abort_after_a_verify_restores_the_cache():
    rng = np.random.default_rng(1)
    cache = _batch([_keys(rng, 5), _keys(rng, 11)])
    before = [np.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    txn = BatchRotatingRollback().begin(cache)
    _feed(cache, [_keys(rng, 3), _keys(rng, 3)])
    txn.abort()
    after = [np.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_rows_cannot_keep_different_amounts_after_one_token_writes():
    """A one-token update writes the buffer in place (the ring may overwrite an entry a
    row still needs): rolling rows back from there is refused, not guessed."""
    rng = np.random.default_rng(2)
    cache = _batch([_keys(rng, W), _keys(rng, 4)])
    _feed(cache, [_keys(rng, 1), _keys(rng, 1)])  # wraps the ring
    txn = BatchRotatingRollback().begin(cache)
    _feed(cache, [_keys(rng, 1), _keys(rng, 1)])
    with pytest.raises(RuntimeError, match="one token at a time"):
        txn.commit(2, [2, 1])
    with pytest.raises(RuntimeError, match="written in place"):
        txn.abort()
    txn.commit(1, 1)  # keeping what was fed needs no rollback


def test_a_block_after_the_ring_wrapped_sees_a_padded_rows_oldest_key():
    """mlx-lm 0.32's mask for a multi-token forward on a wrapped ring drops a padded
    row's oldest valid key; ``order_for_block`` first lays the ring out in temporal order,
    and the padded row's logits equal the prompt run alone."""
    gemma = make_tiny_model("gemma3")
    long, short = list(range(2, 2 + 2 * W)), [5, 9, 11]
    after = [[21, 22], [23, 24]]  # each row's next tokens, fed one round at a time
    block = [7, 3, 12]
    rows = []
    for prompt in (long, short):
        c = gemma.make_cache()
        gemma(mx.array(prompt[:-1])[None], cache=c)
        rows.append(c)
    caches = [type(layers[0]).merge(list(layers)) for layers in zip(*rows)]
    last = [long[-1], short[-1]]
    for s in range(2):  # plain one-token rounds: the sliding layers' ring wraps
        gemma(mx.array([[last[0]], [last[1]]]), cache=caches)
        last = [after[0][s], after[1][s]]
    assert any(type(c) is BatchRotatingKVCache and c.rotated for c in caches)
    feed = mx.array([[last[0], *block], [last[1], *block]])
    order_for_block(caches, feed.shape[1])
    got = gemma(feed, cache=caches)[1]
    ref = gemma(mx.array([*short, *after[1], *block])[None])[0, -4:]
    np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-4)


# -- rows of tiny sliding-window models -------------------------------------------------


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def windowed(request):
    return make_tiny_model(request.param)


def _prompts(model) -> list[list[int]]:
    """Prompts shorter and longer than the window of 8."""
    out = [copy_heavy_prompt(model, [3 + i, 9, 4 + 2 * i, 17], n=6 + 7 * i) for i in range(4)]
    out[0] = out[0][:3]
    return out


def _oracle(model, **kw) -> specdec.Policy:
    opts = {"model": model, "corruption": 0.3, "block": 5, "seed": 3, **kw}
    return specdec.Policy(name="oracle-window", drafters=("oracle",), options={"oracle": opts})


def test_windowed_rows_speculate_and_equal_each_prompt_alone(windowed):
    """Ragged acceptance past the window, with rows joining a running batch."""
    out = check_batch_identity(
        windowed, _oracle(windowed), _prompts(windowed), max_tokens=[40, 24, 40, 30], max_rows=3
    )
    assert out["drafted"] > out["accepted"] > 0
    assert out["max_batch_rows"] == 3


def test_windowed_rows_with_plain_rounds_between_drafts(windowed):
    """Drafts only at some history lengths: one-token rounds wrap the ring in place, then
    a verify block follows (the mask case above), rows joining meanwhile."""
    prompts = _prompts(windowed)
    at = set(range(0, 200, 3))
    out = check_batch_identity(
        windowed, _oracle(windowed, at=at), prompts, max_tokens=36, max_rows=2
    )
    assert out["accepted"] > 0


def test_windowed_sampled_rows_equal_each_prompt_alone(windowed):
    out = check_batch_identity(
        windowed, _oracle(windowed), _prompts(windowed), max_tokens=30, temperature=0.9, seed=5
    )
    assert out["accepted"] > 0


# -- a rollback without per-row support -------------------------------------------------


def test_a_rollback_without_per_row_support_decodes_rows_plainly_together():
    gemma = make_tiny_model("gemma3")
    p = [copy_heavy_prompt(gemma, [5, 6, 7], n=10), copy_heavy_prompt(gemma, [8, 2], n=14)]
    with plugin_host(OneAmountPlugin()):
        pol = specdec.Policy(name="ngram-one", drafters=("ngram_copy",), rollback="one_amount")
        out = check_batch_identity(gemma, pol, p, max_tokens=12, require_drafts=False)
        assert out["drafted"] == 0
        r = specdec.assemble(gemma, None, pol).generate_batch(p, max_tokens=3)[0]
        assert "'one_amount'" in r.stats.speculation_off_reason
