"""specdec.heads.OutputLayer: the target's output layer as rows (exact logits of chosen tokens),
the head contract's ``context`` and ``tokenizer`` hand-over, and draft_model's ``head``."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import specdec
from specdec.testing import ALL_ARCHITECTURES, check_greedy_identity, make_tiny_model, plugin_host


def _states(n=5, hidden=64, seed=0):
    return mx.random.normal((n, hidden), key=mx.random.key(seed)) * 2.0


def _full(model, h):
    return specdec.capture.model_taps(model).head(h[None])[0].astype(mx.float32)


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
@pytest.mark.parametrize("tied", [False, True])
def test_rows_are_the_full_heads_logits(arch, tied):
    model = make_tiny_model(arch, tie_word_embeddings=tied) if tied else make_tiny_model(arch)
    ol = specdec.heads.OutputLayer(model)
    # gemma3 keeps its lm_head unless a checkpoint without one is loaded
    assert ol.tied == (tied and arch != "gemma3") and ol.vocab_size == 64 and ol.hidden_size == 64
    if arch == "gemma4":
        assert ol.post == ("softcap", 10.0)
    else:
        assert ol.post is None
    h = _states()
    full = _full(model, h)
    assert mx.array_equal(ol.logits(h), full)
    ids = mx.array([3, 0, 63, 17, 40])
    # the same products on fewer rows: BLAS orders a matmul's sums by its shape, so
    # equal within float32 rounding
    for rows, ref in (
        (ol.rows(h, ids), full[:, ids]),
        (ol.rows(h[:1], ids), _full(model, h[:1])[:, ids]),
    ):
        np.testing.assert_allclose(np.array(rows), np.array(ref), rtol=1e-6, atol=1e-5)
    per_state = mx.array([[1, 2], [5, 9], [63, 0], [7, 7], [30, 31]])
    np.testing.assert_allclose(
        np.array(ol.rows(h, per_state)),
        np.array(mx.take_along_axis(full, per_state, axis=-1)),
        rtol=1e-6,
        atol=1e-5,
    )
    # the dense rows are the weights the logits come from
    assert mx.array_equal(ol.take(ids), ol.dense()[ids])


def test_rows_of_a_quantized_head_use_its_own_arithmetic():
    model = make_tiny_model("llama", seed=11)
    nn.quantize(model, group_size=32, bits=4)
    ol = specdec.heads.OutputLayer(model)
    assert ol.quantized == (4, 32, "affine") and ol.hidden_size == 64
    h = _states(3)
    full = _full(model, h)
    ids = mx.array([1, 8, 62, 33])
    np.testing.assert_allclose(np.array(ol.rows(h, ids)), np.array(full[:, ids]), atol=1e-5)
    # dequantized rows reproduce the quantized layer's logits
    np.testing.assert_allclose(np.array(h @ ol.dense().T), np.array(full), atol=1e-4, rtol=1e-4)


def test_an_output_path_that_is_not_a_known_scaling_is_refused():
    model = make_tiny_model("qwen3", seed=12)

    class Odd(type(model)):
        def __call__(self, *a, **k):
            return super().__call__(*a, **k) ** 2  # not softcap, not a scale

    odd = Odd(model.args)
    odd.update(model.parameters())
    with pytest.raises(specdec.ModelLoadError, match="output path.*tried: none"):
        specdec.heads.OutputLayer(odd)


def test_output_layer_is_made_once_per_model():
    model = make_tiny_model("llama", seed=13)
    assert specdec.heads.output_layer(model) is specdec.heads.output_layer(model)


# -- the head contract: context and tokenizer ---------------------------------------


class _Recording:
    """A head that records what it was bound with and the contexts it was given."""

    name = "recording_head"
    instances: list = []

    def __init__(self):
        self.vocab_size = None
        self.bound = None
        self.contexts = []
        _Recording.instances.append(self)

    def bind(self, model, tokenizer=None):
        self.bound = (model, tokenizer)
        self.out = specdec.heads.output_layer(model)
        self.vocab_size = self.out.vocab_size

    def logits(self, hidden, context=None):
        self.contexts.append(None if context is None else list(context))
        return self.out.logits(hidden)

    def stats(self):
        return {"calls": len(self.contexts)}


class _OldStyle:
    """A head written before 0.2.4: bind(model), logits(hidden)."""

    name = "old_head"

    def bind(self, model):
        self.out = specdec.heads.output_layer(model)
        self.vocab_size = self.out.vocab_size

    def logits(self, hidden):
        return self.out.logits(hidden)

    def stats(self):
        return {}


class _Heads:
    @specdec.hookimpl
    def specdec_register_draft_heads(self, register):
        register("recording_head", _Recording)
        register("old_head", _OldStyle)


def _draft_policy(draft, head, n=3):
    return {
        "drafters": ["draft_model"],
        "options": {"draft_model": {"model": draft, "num_draft_tokens": n, "head": head}},
    }


def test_draft_model_head_binds_to_the_draft_model_and_gets_the_context(models, copy_prompts):
    target = models["llama"]
    draft = make_tiny_model("llama", seed=3)
    _Recording.instances.clear()
    with plugin_host(_Heads()) as host:
        pipe = specdec.assemble(target, policy=_draft_policy(draft, "recording_head"), host=host)
        out = pipe.generate(copy_prompts["llama"], max_tokens=10)
    (head,) = _Recording.instances
    assert head.bound[0] is draft  # the draft model's output layer, not the target's
    assert out.stats.drafted > 0 and head.contexts
    # every draft step is told the request's tokens so far (the prompt at least)
    prompt = list(copy_prompts["llama"])
    assert all(c is not None and c[: len(prompt)] == prompt for c in head.contexts)


@pytest.mark.parametrize("head", ["exact", "recording_head", "old_head"])
def test_draft_model_through_a_head_drafts_what_the_draft_model_would(models, copy_prompts, head):
    """The target as its own draft through the exact logits: every draft is accepted."""
    target = models["qwen3"]
    with plugin_host(_Heads()):
        res = check_greedy_identity(
            target,
            specdec.Policy.from_dict(_draft_policy(target, head)),
            copy_prompts["qwen3"],
            max_tokens_list=(1, 7, 16),
        )
    assert res["accepted"] == res["drafted"] > 0


def test_draft_model_head_option_is_checked():
    # draft_model's head: str | None: the assembly checks the type before the drafter runs
    with pytest.raises(specdec.PolicyError, match="draft_model.*option head must be a string"):
        specdec.assemble(
            make_tiny_model("llama"),
            policy={
                "drafters": ["draft_model"],
                "options": {"draft_model": {"model": make_tiny_model("llama"), "head": 3}},
            },
        )
