"""The prefix cache: longest shared prefix, copies, trimming, LRU bounds; and a
conversation served turn by turn from it, identical to each turn from scratch."""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import make_tiny_model
from specdec_serve import Engine
from specdec_serve.engine import Job
from specdec_serve.prefix import PrefixCache


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


def _filled(model, ids):
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _keys(cache):
    return [np.array(c.keys[..., : c.offset, :]) for c in cache]


def test_fetch_takes_the_longest_shared_prefix_as_a_trimmed_copy(llama):
    pc = PrefixCache(max_bytes=1 << 30)
    a, b = list(range(1, 21)), [*range(1, 11), 40, 41, 42]
    ca, cb = _filled(llama, a), _filled(llama, b)
    saved = _keys(ca)
    assert pc.insert(a, ca) and pc.insert(b, cb)
    assert pc.fetch([7, 8, 9]) is None
    # shares 15 tokens with a (a's entry, trimmed to 15) and 10 with b
    snap = pc.fetch([*range(1, 16), 50, 51])
    caches, n = snap.caches, len(snap.tokens)
    assert n == 15 and all(c.offset == 15 for c in caches) and snap.ordered
    assert snap.tokens == tuple(range(1, 16))
    for got, want in zip(_keys(caches), saved):
        assert np.array_equal(got, want[..., :15, :])
    # the copy is the caller's: writing it leaves the entry as it was
    llama(mx.array([[50, 51]]), cache=caches)
    assert all(c.offset == 20 for c in ca) and all(
        np.array_equal(x, y) for x, y in zip(_keys(ca), saved)
    )
    # a prompt equal to an entry reuses all but its last token
    assert len(pc.fetch(a).tokens) == 19
    assert pc.stats()["hits"] == 2 and pc.stats()["misses"] == 1


def test_an_unordered_entry_serves_only_whole(llama):
    pc = PrefixCache(max_bytes=1 << 30)
    a = list(range(1, 21))
    pc.insert(a, _filled(llama, a), ordered=False)
    assert pc.fetch([*range(1, 16), 50]) is None  # would need a trim
    assert pc.fetch(a) is None  # would need a trim too (the last token is fed)
    snap = pc.fetch([*a, 60, 61])
    assert len(snap.tokens) == 20 and all(c.offset == 20 for c in snap.caches)
    assert not snap.ordered  # a request going on from it holds unordered caches too


def test_an_ordered_entry_replaces_its_prefixes_and_lru_bounds_hold(llama):
    pc = PrefixCache(max_bytes=1 << 30, max_entries=2)
    a = list(range(1, 11))
    pc.insert(a[:5], _filled(llama, a[:5]))
    pc.insert(a, _filled(llama, a))
    assert len(pc) == 1  # the longer entry serves the shorter one's prompts
    pc.insert([30, 31, 32], _filled(llama, [30, 31, 32]))
    pc.fetch([*a, 5])  # a is now the most recently used
    pc.insert([40, 41], _filled(llama, [40, 41]))
    assert len(pc) == 2 and pc.fetch([30, 31, 32, 33]) is None
    one = pc.nbytes // 2
    small = PrefixCache(max_bytes=one)  # room for one entry of this size
    small.insert(a, _filled(llama, a))
    assert small.nbytes <= one and len(small) <= 1
    huge = PrefixCache(max_bytes=10)
    assert not huge.insert(a, _filled(llama, a)) and len(huge) == 0
    with pytest.raises(ValueError, match="max_entries >= 1"):
        PrefixCache(max_entries=0)


def _run(engine, policy, ids, **params):
    """One request through the engine's worker: (token ids, stats)."""
    loop = asyncio.new_event_loop()
    job = Job(policy, ids, {"max_tokens": 40, "temperature": 0.0, **params}, loop)
    engine.submit(job)

    async def drain():
        out = []
        while True:
            item = await job.out.get()
            if item[0] == "token":
                if not item[1].is_stop_token:
                    out.append(item[1].token)
            elif item[0] == "done":
                return out, item[1]
            else:
                raise item[1]

    try:
        return loop.run_until_complete(drain())
    finally:
        loop.close()


CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(12))


def _conversation(engine, policy, turns=3):
    """A conversation that grows by the answer and a question each turn; every turn's
    answer equals the same prompt decoded from scratch by the plain pipeline."""
    msgs = [{"role": "user", "content": "Rewrite this code, renaming x to y:\n" + CODE}]
    plain = engine.pipe("none")
    cached, accepted = [], 0
    for turn in range(turns):
        ids = engine.chat_ids(msgs)
        got, stats = _run(engine, policy, ids)
        want = plain.generate(ids, max_tokens=40)
        assert got == want.tokens, f"turn {turn}"
        assert stats["prompt_tokens"] == len(ids)
        cached.append(stats["cached_tokens"])
        accepted += stats["accepted"] or 0
        text = engine.tokenizer.decode(want.tokens)
        msgs += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Again {turn}."},
        ]
    return cached, accepted


def test_a_conversation_reuses_each_turn_in_a_batch(server):
    _, engine = server
    engine.prefix.clear()
    cached, accepted = _conversation(engine, "copy")
    assert cached[0] == 0 and all(c > 100 for c in cached[1:]), cached
    assert accepted > 0


def test_a_conversation_reuses_each_turn_running_alone(server, monkeypatch):
    _, engine = server
    engine.prefix.clear()
    # as a policy whose components cannot run rows of a batch: each request alone
    monkeypatch.setitem(engine.unbatched, "copy", "for this test")
    cached, accepted = _conversation(engine, "copy")
    assert cached[0] == 0 and all(c > 100 for c in cached[1:]), cached
    assert accepted > 0


def test_usage_and_metrics_report_cached_tokens(server, client):
    base, engine = server
    engine.prefix.clear()
    msgs = [{"role": "user", "content": "List the fruits: apples, pears, plums, figs."}]
    first = client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model=engine.model_name, messages=msgs, max_tokens=8)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    stream = client.chat.completions.create(
        model=engine.model_name,
        messages=msgs,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
    text = httpx.get(base + "/metrics").text
    assert "specdec_prefix_cache_entries 1" in text
    assert 'specdec_prefix_cache_lookups_total{result="hit"}' in text
    total = [ln for ln in text.splitlines() if ln.startswith("specdec_prompt_cached_tokens_total")]
    assert int(total[0].split()[-1]) >= 2 * (first.usage.prompt_tokens - 1)
    assert httpx.get(base + "/health").json()["prefix_cache"]["entries"] == 1


def test_prefix_reuse_can_be_turned_off():
    with pytest.raises(specdec.PolicyError, match="prompt_cache_size must be an integer >= 1"):
        Engine(None, ["none"], prompt_cache_size=0)
    engine = Engine(None, ["none"], prompt_cache_bytes=0)
    try:
        assert engine.prefix is None
        ids = engine.chat_ids([{"role": "user", "content": "Hi."}])
        for _ in range(2):
            got, stats = _run(engine, "none", ids, max_tokens=6)
            assert stats["cached_tokens"] == 0
        assert got == engine.pipe("none").generate(ids, max_tokens=6).tokens
    finally:
        engine.close()
