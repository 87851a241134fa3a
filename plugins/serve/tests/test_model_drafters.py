"""A server whose policy drafts with a model: its requests are rows of one batch, each
row's drafts from one draft forward per step for all rows."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from conftest import _serve
from specdec.loading import default_model_path
from specdec_serve import Engine


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    """The default model served with ``none`` and a policy drafting with the default
    model itself (every draft accepted: the drafting is what is tested, not its speed)."""
    toml = tmp_path_factory.mktemp("policy") / "draft-self.toml"
    toml.write_text(
        'name = "draft-self"\ndrafters = ["draft_model"]\n\n[options.draft_model]\n'
        f'model = "{default_model_path()}"\nnum_draft_tokens = 3\n'
    )
    engine = Engine(None, ["none", str(toml)], model_name="drafts")
    srv, thread, base = _serve(engine)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    yield base, engine, client
    srv.should_exit = True
    thread.join(timeout=10)
    engine.close()


def test_streaming_clients_of_a_model_drafter_policy_get_what_they_would_alone(draft_server):
    base, engine, client = draft_server
    prompts = [f"Write {i + 2} words about the sea." for i in range(8)]

    def one(i: int):
        stream = list(
            client.chat.completions.create(
                model=engine.model_name,
                messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"policy": "draft-self"},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        return text, stream[-1].usage.completion_tokens

    t = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, range(8)))
    elapsed = time.perf_counter() - t
    for i, (text, _) in enumerate(got):
        ids = engine.chat_ids([{"role": "user", "content": prompts[i]}])
        assert text == engine.pipe("none").generate(ids, max_tokens=12).text, i
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok" and h["queue_length"] == 0
    metrics = httpx.get(base + "/metrics").text
    assert "specdec_failed_requests_total 0" in metrics
    print(f"\nload, draft_model policy: 8 streaming clients in {elapsed:.1f} s")


def test_concurrent_model_drafter_requests_share_rounds_and_drafts_are_accepted(draft_server):
    _, engine, client = draft_server
    msgs = [[{"role": "user", "content": f"Count from {i} to {i + 9}."}] for i in range(3)]

    def one(m):
        return client.chat.completions.create(
            model=engine.model_name,
            messages=m,
            max_tokens=20,
            extra_body={"policy": "draft-self"},
        )

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(one, msgs))
    rows = [r.model_extra["specdec"]["batch_rows"] for r in got]
    assert any(int(k) >= 2 for r in rows for k in r), rows
    assert all(r.model_extra["specdec"]["accepted"] > 0 for r in got)
    for m, r in zip(msgs, got):
        want = engine.pipe("none").generate(engine.chat_ids(m), max_tokens=20).text
        assert r.choices[0].message.content == want
