"""Model drafters in a batch: the ``DrafterBatch`` contract (one ``propose`` for every
asking row, rows joining and leaving) and ``draft_model`` drafting every row's block
with one draft forward per step."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
import specdec
from specdec.testing import check_batch_identity, copy_heavy_prompt, make_tiny_model, plugin_host


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(llama):
    out = [copy_heavy_prompt(llama, [3 + i, 9, 4 + 2 * i, 17], n=8 + 5 * i) for i in range(4)]
    out[1] = out[1][:5]
    return out


class Counting:
    """An mlx-lm model whose forwards are counted (and the rows each one had)."""

    def __init__(self, model: Any):
        self.model = model
        self.calls: list[int] = []

    def __call__(self, tokens, cache=None, **kw):
        self.calls.append(int(tokens.shape[0]))
        return self.model(tokens, cache=cache, **kw)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _draft_policy(draft: Any, k: int = 3, **extra) -> specdec.Policy:
    return specdec.Policy(
        name="draft-batch",
        drafters=("draft_model",),
        options={"draft_model": {"model": draft, "num_draft_tokens": k}},
        **extra,
    )


def test_the_target_as_its_own_draft_model_drafts_all_rows_in_one_forward_per_step(llama, prompts):
    """Every draft is accepted (the draft is the target), rows join as others finish, and
    each draft step is one forward over all rows."""
    draft = Counting(llama)
    out = check_batch_identity(
        llama, _draft_policy(draft), prompts, max_tokens=[20, 9, 16, 20], max_rows=3
    )
    assert out["accepted"] == out["drafted"] > 0
    assert out["max_batch_rows"] == 3
    batched = [b for b in draft.calls if b > 1]
    assert batched and max(batched) == 3  # forwards over several rows at once


def test_a_different_draft_model_rows_reject_at_different_places(llama, prompts):
    other = make_tiny_model("llama", seed=3)
    out = check_batch_identity(llama, _draft_policy(other, k=4), prompts, max_tokens=24)
    assert out["drafted"] > out["accepted"] > 0


def test_draft_rows_mixed_with_copy_drafts(llama, prompts):
    """``ngram_copy`` first: rows whose context has a match copy, the others ask the draft
    model (which catches up on the copied tokens in its next forward)."""
    pol = specdec.Policy(
        name="copy-then-draft",
        drafters=("ngram_copy", "draft_model"),
        options={
            # the target as its own draft: its drafts are accepted wherever it drafts (a
            # random draft model's were accepted by luck: a CI run accepted none)
            "draft_model": {"model": llama, "num_draft_tokens": 3},
            # the ladder: block sizes from outcomes, not from this machine's verify cost
            # curve, so which rounds copy (and which ask the draft model) is the same on
            # every machine
            "ngram_copy": {"sizing": "ladder"},
        },
    )
    out = check_batch_identity(llama, pol, prompts, max_tokens=30, max_rows=2)
    assert out["accepted"] > 0
    r = specdec.assemble(llama, None, pol).generate_batch(prompts, max_tokens=30)
    per = [x.stats.per_drafter for x in r]
    assert any(p.get("draft_model", {}).get("accepted", 0) > 0 for p in per)
    assert any(p.get("ngram_copy", {}).get("accepted", 0) > 0 for p in per)


def test_sampled_draft_rows_equal_the_same_policy_alone(llama, prompts):
    """At temperature > 0 a draft model's ``q`` goes to rejection sampling; position-keyed
    draws make each row what the same request gives alone."""
    pol = _draft_policy(make_tiny_model("llama", seed=3), k=3)
    out = check_batch_identity(
        llama, pol, prompts, max_tokens=20, temperature=0.8, seed=11, against="policy"
    )
    assert out["accepted"] > 0


def test_a_row_from_a_cached_prompt_prefix_feeds_its_draft_model_the_rest(llama, prompts):
    from mlx_lm.models.cache import make_prompt_cache

    ids = prompts[3]
    cache = make_prompt_cache(llama)
    llama(mx.array(ids[:10])[None], cache=cache)
    pipe = specdec.assemble(llama, None, _draft_policy(llama))
    want = specdec.assemble(llama, None, "none").generate(ids, max_tokens=16).tokens
    batch = pipe.batch(2)
    batch.add(ids, prompt_cache=cache, max_tokens=16)
    batch.add(prompts[0], max_tokens=16)
    got: list[int] = []
    stats = None
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            if ev.row == 0:
                got.append(ev.response.token)
                stats = ev.response.stats or stats
    assert got == want
    assert stats.accepted > 0


def test_a_sliding_window_draft_model_is_refused_for_a_batch(llama):
    pipe = specdec.assemble(
        make_tiny_model("gemma3"), None, _draft_policy(make_tiny_model("gemma3", seed=1))
    )
    with pytest.raises(specdec.PolicyError, match="BatchRotatingKVCache"):
        pipe.batch(2)


# -- the contract, with a drafter of the test's own ---------------------------------------


class _Echo:
    """Proposes the last token ``k`` times for every row, all rows in one call."""

    def __init__(self, log: list):
        self.log = log
        self.rows: list[int] = []

    def join(self, row, session):
        self.rows.append(row)
        self.log.append(("join", row))

    def leave(self, rows):
        self.rows = [r for r in self.rows if r not in rows]
        self.log.append(("leave", tuple(rows)))

    def propose(self, asks, caches):
        assert [a.index for a in asks] == sorted(a.index for a in asks)
        assert all(c.offset.shape[0] > max(a.index for a in asks) for c in caches)
        self.log.append(("propose", tuple(a.row for a in asks)))
        if any(a.history[0] == 63 for a in asks):
            raise ValueError("a prompt starting with 63")
        return [specdec.Draft(tokens=[a.history[-1]] * min(2, a.max_len)) for a in asks]

    def observe(self, results):
        self.log.append(("observe", tuple(sorted(results))))

    def end(self):
        self.log.append(("end",))


class _EchoSession(specdec.BaseDrafterSession):
    def propose(self, history, max_len):  # pragma: no cover - the batch asks _Echo
        raise AssertionError("a batched row's session is not asked")


class _EchoDrafter(specdec.BaseDrafter):
    name = "echo"
    supports_batch = True
    log: list = []

    def session(self, ctx):
        return _EchoSession()

    def batch(self, ctx):
        assert isinstance(ctx, specdec.roles.BatchContext) and ctx.max_rows == 2
        return _Echo(self.log)


class _EchoPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("echo", _EchoDrafter)


def test_one_propose_for_every_asking_row_and_joins_and_leaves_in_order(llama, prompts):
    _EchoDrafter.log = log = []
    with plugin_host(_EchoPlugin()) as host:
        pipe = specdec.assemble(llama, None, {"name": "echo", "drafters": ["echo"]}, host=host)
        want = [
            specdec.assemble(llama, None, "none").generate(p, max_tokens=8).tokens
            for p in prompts[:3]
        ]
        got = pipe.generate_batch(prompts[:3], max_tokens=8, max_rows=2)
    assert [r.tokens for r in got] == want
    proposes = [e for e in log if e[0] == "propose"]
    assert proposes and all(len(e[1]) <= 2 for e in proposes)
    assert any(len(e[1]) == 2 for e in proposes)  # two rows in one call
    assert log[0] == ("join", 0) and log[1] == ("join", 1) and log[-1] == ("end",)
    first_leave = next(i for i, e in enumerate(log) if e[0] == "leave")
    assert log.index(("join", 2)) > first_leave  # the third row joined once a row had left
    assert sorted(r for e in log if e[0] == "leave" for r in e[1]) == [0, 1, 2]


def test_a_batched_propose_that_raises_fails_the_asking_rows_alone(llama, prompts):
    _EchoDrafter.log = []
    bad = [63, *prompts[0][1:]]
    with plugin_host(_EchoPlugin()) as host:
        pipe = specdec.assemble(llama, None, {"name": "echo", "drafters": ["echo"]}, host=host)
        batch = pipe.batch(2)
        a = batch.add(bad, max_tokens=6)
        errors = []
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    errors.append((ev.row, ev.error))
        b = batch.add(prompts[1], max_tokens=6)  # the batch goes on serving
        out = []
        while len(batch):
            for ev in batch.step():
                assert ev.error is None, ev.error
                out.append(ev.response.token)
    assert [r for r, _ in errors] == [a]
    assert isinstance(errors[0][1], specdec.ComponentError)
    assert "echo" in str(errors[0][1]) and "propose" in str(errors[0][1])
    want = specdec.assemble(llama, None, "none").generate(prompts[1], max_tokens=6).tokens
    assert out == want and b == a + 1


# -- failures and ordering (found by review) ------------------------------------------------


class _NoneBatch:
    """A batch state that proposes nothing (its rows go on to the next drafter)."""

    def join(self, row, session):
        pass

    def leave(self, rows):
        pass

    def propose(self, asks, caches):
        return [None for _ in asks]

    def observe(self, results):
        pass

    def end(self):
        pass


class _NoneDrafter(specdec.BaseDrafter):
    name = "nothing"
    supports_batch = True

    def session(self, ctx):
        return _EchoSession()

    def batch(self, ctx):
        return _NoneBatch()


class _SkipSession(specdec.BaseGovernorSession):
    """Gives row 1 no budget for ``nothing`` (it goes straight to the next drafter), and
    row ``silent`` no budget at all on its rounds ``rounds``."""

    def __init__(self, row, silent=None, rounds=()):
        self.row, self.silent, self.rounds, self.n = row, silent, set(rounds), 0

    def budget(self, drafter, max_len):
        if self.row == self.silent and drafter == "draft_model":
            self.n += 1
            if self.n in self.rounds:
                return 0
        return 0 if (drafter == "nothing" and self.row == 1) else max_len


class _Skip(specdec.BaseGovernor):
    name = "skip"
    supports_batch = True
    silent = None
    rounds: tuple = ()

    def session(self, ctx):
        return _SkipSession(ctx.row, self.silent, self.rounds)


class _OrderPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("nothing", _NoneDrafter)

    @specdec.hookimpl
    def specdec_register_governors(self, register):
        register("skip", _Skip)


def test_rows_that_reach_a_batched_drafter_in_different_orders_ask_it_once(llama, prompts):
    """Row 1 skips the first drafter, row 0 goes through it: both reach ``draft_model``
    in the same round, which is asked once for both."""
    draft = Counting(make_tiny_model("llama", seed=3))
    with plugin_host(_OrderPlugin()):
        pol = specdec.Policy(
            name="order",
            drafters=("nothing", "draft_model"),
            governor="skip",
            options={"draft_model": {"model": draft, "num_draft_tokens": 3}},
        )
        out = check_batch_identity(llama, pol, prompts[:2], max_tokens=16)
    assert out["drafted"] > 0
    # every draft forward over both rows: never a second call for a row in one round
    assert draft.calls and all(b == 2 for b in draft.calls[-5:])


def test_a_failed_draft_step_leaves_the_other_rows_draft_caches_in_step(llama, prompts):
    """``propose`` raising after the catch-up forward: the asking row fails, the row that
    did not ask keeps its draft cache and its count of what it holds in step, so every
    later draft of the target-as-draft is accepted."""
    from specdec.drafters import draft_model as dm

    armed = {"on": False}
    real = dm.DraftModelBatch._logits

    def flaky(self, tokens, want, last):
        if armed["on"] and last is None:  # a draft step after the catch-up forward
            armed["on"] = False
            raise RuntimeError("a draft step failed")
        return real(self, tokens, want, last)

    class Arm(_SkipSession):
        def budget(self, drafter, max_len):
            b = super().budget(drafter, max_len)
            if b == 0 and drafter == "draft_model":
                armed["on"] = True
            return b

    class Gov(_Skip):
        def session(self, ctx):
            return Arm(ctx.row, silent=1, rounds=(3,))

    class Plugin:
        @specdec.hookimpl
        def specdec_register_governors(self, register):
            register("arm", Gov)

    dm.DraftModelBatch._logits = flaky
    try:
        with plugin_host(Plugin()) as host:
            pol = _draft_policy(llama, governor="arm")
            batch = specdec.assemble(llama, None, pol, host=host).batch(2)
            a = batch.add(prompts[0], max_tokens=30)
            b = batch.add(prompts[1], max_tokens=30)
            state = batch._drafting["draft_model"]
            errors, stats = {}, {}
            while len(batch):
                for ev in batch.step():
                    if ev.error is not None:
                        errors[ev.row] = ev.error
                    elif ev.response.stats is not None:
                        stats[ev.row] = ev.response.stats
                if b in state.sessions:
                    c, s = state.caches[0], state.sessions[b]
                    assert int(c.offset[state.rows.index(b)].item()) == s.fed
    finally:
        dm.DraftModelBatch._logits = real
    assert list(errors) == [a] and "a draft step failed" in str(errors[a].__cause__)
    assert stats[b].accepted == stats[b].drafted > 0


class _LeavesBadly(_Echo):
    def leave(self, rows):
        super().leave(rows)
        if len([e for e in self.log if e[0] == "leave"]) == 1:
            raise ValueError("leave failed")


class _LeavesBadlyDrafter(_EchoDrafter):
    def batch(self, ctx):
        return _LeavesBadly(self.log)


class _LeavesBadlyPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("echo", _LeavesBadlyDrafter)


def test_a_batch_state_that_fails_ends_its_rows_and_later_rows_get_a_new_one(llama, prompts):
    _LeavesBadlyDrafter.log = log = []
    with plugin_host(_LeavesBadlyPlugin()) as host:
        pipe = specdec.assemble(llama, None, {"name": "echo", "drafters": ["echo"]}, host=host)
        batch = pipe.batch(2)
        first = batch.add(prompts[0], max_tokens=2)
        held = batch.add(prompts[1], max_tokens=20)
        errors, done = {}, {}
        later = None
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    errors[ev.row] = ev.error
                elif ev.response.finish_reason is not None:
                    done[ev.row] = ev.response
            if first in done and later is None:
                later = batch.add(prompts[2], max_tokens=6)
    assert list(errors) == [held]  # the row the failed state still held
    assert "leave" in str(errors[held]) and "leave failed" in str(errors[held].__cause__)
    assert later in done  # a row that joined later drafted with a new state
    assert [e for e in log if e[0] == "end"]
