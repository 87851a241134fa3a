"""specdec_train: what the head plugins' training commands share (recording the
target, its K/V, batched answers, the shipped prompts). The target identity a trained
head records is the core's (tests/test_checkpoints.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import make_tiny_model, plain_greedy
from specdec_train import batch_answers, record, shipped_prompts


def test_the_shipped_prompts_are_no_bench_workload():
    from specdec.bench import get_workloads

    prompts = shipped_prompts()
    assert len(prompts) >= 30
    requests = " ".join(w.request for w in get_workloads())
    assert not any(p in requests for p in prompts)


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_record_keeps_every_positions_kv_as_the_caches_hold_it(arch):
    model = make_tiny_model(arch)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 64, 20)]
    kv_layers = tuple(range(len(make_prompt_cache(model))))
    rec = record(model, tokens, top_k=3, kv_layers=kv_layers)
    assert rec.hidden.shape[0] == 20 and rec.top_ids.shape == (20, 3)
    # a fresh cache fed token by token (a gemma4 sliding window of 8 wraps): its view at
    # each step is the tail of the recorded K/V
    caches = make_prompt_cache(model)
    for i, t in enumerate(tokens):
        model(mx.array([[t]]), cache=caches)
        for j in kv_layers:
            v = specdec.kvview.kv_view(caches[j], full_window=True)
            keys = np.asarray(rec.kv[j][0][: i + 1].transpose(1, 0, 2))[:, -v.length :]
            np.testing.assert_allclose(np.asarray(v.keys[0]), keys, atol=1e-4)
    assert any(specdec.kvview.kv_view(c).window for c in caches) == (arch == "gemma4")


def test_batched_answers_record_each_rows_own_kv_and_layer_outputs():
    model = make_tiny_model("llama")
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2], [9]]
    answers, states = batch_answers(
        model, prompts, max_tokens=10, record=2, kv_layers=(0, 1), layers=(1, 0), batch_size=3
    )
    for p, a, st in zip(prompts, answers, states):
        assert a == plain_greedy(model, p, 10)  # left padding changes nothing
        ref = record(model, p + a, kv_layers=(0, 1), layers=(0, 1))
        n = st.hidden.shape[0]
        assert n == len(p + a) - 1
        for j in (0, 1):
            for got, want in zip(st.kv[j], ref.kv[j]):
                assert got.shape == (n, *want.shape[1:])
                np.testing.assert_allclose(np.asarray(got), np.asarray(want[:n]), atol=1e-4)
            # the decoder layers' outputs, each row's own, as one teacher-forced forward
            assert st.layers[j].shape == (n, ref.layers[j].shape[-1])
            np.testing.assert_allclose(
                np.asarray(st.layers[j]), np.asarray(ref.layers[j][:n]), atol=1e-4
            )
        assert sorted(st.layers) == [0, 1] and not record(model, p).layers
    # a model with sliding-window caches cannot be batched this way: None (one by one)
    assert batch_answers(make_tiny_model("gemma4"), prompts, max_tokens=2) is None
