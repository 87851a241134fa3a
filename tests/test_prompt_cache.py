"""``Pipeline.stream`` / ``generate`` take a ``prompt_cache`` as mlx-lm's ``stream_generate``
does: a cache holding the prompt's first tokens; only the rest is prefilled, and the
cache is used in place, so a conversation's next turn prefills only what is new."""

from __future__ import annotations

import mlx.core as mx
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import find_copy_prompt, make_tiny_model, plugin_host


def _policy(name, model):
    if name == "draft_model":  # the target as its own draft model
        return specdec.Policy(
            name="draft",
            drafters=("draft_model",),
            options={"draft_model": {"model": model, "num_draft_tokens": 4}},
        )
    if name == "none":
        return specdec.load_policy("none")
    return specdec.load_policy(name).with_options("ngram_copy", round_overhead=False)


@pytest.mark.parametrize("name", ["none", "ngram", "copy", "draft_model"])
def test_a_conversation_continued_from_its_cache_equals_it_from_scratch(models, name):
    model = models["llama"]
    pol = _policy(name, model)
    first = find_copy_prompt(model, "ngram", max_tokens=24) if name != "none" else [1, 2, 3]
    pipe = specdec.assemble(model, policy=pol)
    plain = specdec.assemble(model, policy="none")
    cache = make_prompt_cache(model)
    turn1 = pipe.generate(first, prompt_cache=cache, max_tokens=12)
    assert turn1.tokens == plain.generate(first, max_tokens=12).tokens
    assert turn1.stats.cached_tokens == 0
    held = cache[0].offset
    conversation = first + turn1.tokens
    assert len(first) - 1 < held <= len(conversation)
    # the next turn: the whole conversation, then a new "user turn" repeating earlier text
    second = conversation + first[:8]
    turn2 = pipe.generate(second, prompt_cache=cache, max_tokens=24)
    fresh = pipe.generate(second, max_tokens=24)
    assert turn2.tokens == fresh.tokens == plain.generate(second, max_tokens=24).tokens
    assert turn2.stats.cached_tokens == held
    assert turn2.stats.prompt_tokens == len(second)
    if name != "none":
        assert turn2.stats.drafted > 0 and turn2.stats.accepted > 0


def test_a_cache_prefilled_by_mlx_lm_is_continued():
    model = make_tiny_model("qwen3")
    prompt = [5, 9, 2, 33, 17, 40, 8, 21, 5, 9, 2, 33]
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:7])[None], cache=cache)  # what mlx-lm's prefill does
    pipe = specdec.assemble(model, policy=_policy("ngram", model))
    out = pipe.generate(prompt, prompt_cache=cache, max_tokens=10)
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=10)
    assert out.tokens == plain.tokens and out.stats.cached_tokens == 7


@pytest.mark.parametrize(
    "bad, words",
    [
        ("not a cache", "prompt_cache must be a list of the model's 2 per-layer caches"),
        ([], "got list of 0"),
        ("other-model", "got list of 3"),
        ("too-long", "prompt_cache holds 5 tokens; the prompt has 5"),
    ],
)
def test_a_bad_prompt_cache_is_refused_before_any_model_work(models, bad, words):
    model = models["llama"]
    pipe = specdec.assemble(model, policy="ngram")
    prompt = [1, 2, 3, 4, 5]
    if bad == "other-model":
        bad = make_prompt_cache(make_tiny_model("llama", num_hidden_layers=3))
    elif bad == "too-long":
        bad = make_prompt_cache(model)
        model(mx.array(prompt)[None], cache=bad)
    before = [getattr(c, "offset", None) for c in bad] if isinstance(bad, list) else None
    with pytest.raises(specdec.RequestError, match=words):
        pipe.stream(prompt, prompt_cache=bad)
    if before is not None:
        assert [c.offset for c in bad] == before  # nothing was fed
    assert pipe.generate(prompt, max_tokens=4).tokens  # and the pipeline serves


class _ReadsPrefill(specdec.BaseDrafter):
    """Records what its session sees: ``ctx.cached`` and the prefill chunks' positions."""

    name = "reads_prefill"
    seen: list = []

    def session(self, ctx):
        self.seen.append(("cached", ctx.cached))
        return _ReadsPrefillSession(self.seen)


class _ReadsPrefillSession(specdec.BaseDrafterSession):
    def __init__(self, seen):
        self.seen = seen

    def prefill(self, chunk):
        self.seen.append(("chunk", chunk.start_position, len(chunk.tokens)))

    def propose(self, history, max_len):
        return None


class _Plugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("reads_prefill", _ReadsPrefill)


def test_sessions_see_what_the_cache_held_and_only_the_new_chunks(models):
    model = models["llama"]
    with plugin_host(_Plugin(), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["reads_prefill"]}, host=host)
        cache = make_prompt_cache(model)
        model(mx.array([1, 2, 3])[None], cache=cache)
        _ReadsPrefill.seen.clear()
        out = pipe.generate(
            list(range(1, 12)), prompt_cache=cache, max_tokens=4, prefill_step_size=4
        )
        assert _ReadsPrefill.seen == [("cached", 3), ("chunk", 3, 4), ("chunk", 7, 3)]
        assert out.stats.cached_tokens == 3 and cache[0].offset >= 10
