"""The verify cost curve, its profiling and cache, best_block, acceptance estimates,
shadow scoring, and how the pipeline hands them to drafters and governors."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec.costs import CostModel, VerifyCostCurve, model_fingerprint
from specdec.testing import make_tiny_model, plugin_host


def curve(rows, widths=(1, 2, 4, 8), contexts=(100, 1000)):
    return VerifyCostCurve(widths=widths, contexts=contexts, seconds=tuple(map(tuple, rows)))


# -- the curve -------------------------------------------------------------------


def test_curve_interpolates_and_extrapolates():
    c = curve([(1.0, 2.0, 4.0, 8.0), (2.0, 3.0, 5.0, 13.0)])
    assert c.cost(4, 100) == 4.0 and c.cost(8, 1000) == 13.0
    assert c.cost(3, 100) == pytest.approx(3.0)  # between widths 2 and 4
    assert c.cost(12, 100) == pytest.approx(12.0)  # past 8: the last slope (1 per token)
    assert c.cost(2, 550) == pytest.approx(2.5)  # between the contexts
    assert c.cost(2, 50) == 2.0  # before the first context: the first row
    assert c.cost(1, 1900) == pytest.approx(3.0)  # past the last context: the last slope
    assert c.relative(1, 500) == 1.0
    assert c.relative(8, 100) == pytest.approx(8.0)


def test_curve_round_trips_and_rejects_bad_tables():
    c = curve([(1.0, 2.0, 4.0, 8.0), (2.0, 3.0, 5.0, 13.0)])
    assert VerifyCostCurve.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ValueError, match="format"):
        VerifyCostCurve.from_dict({**c.to_dict(), "format": 99})
    with pytest.raises(ValueError, match="widths"):
        VerifyCostCurve(widths=(2, 1), contexts=(1,), seconds=((1.0, 1.0),))
    with pytest.raises(ValueError, match="one row per context"):
        VerifyCostCurve(widths=(1, 2), contexts=(1, 2), seconds=((1.0, 1.0),))
    merged = c.merged(curve([(9.0, 9.0, 9.0, 9.0)], contexts=(5000,)))
    assert merged.contexts == (100, 1000, 5000) and merged.cost(1, 5000) == 9.0
    assert "context" in c.table() and "8" in c.table().splitlines()[0]


def test_profile_measures_every_width_and_context_and_leaves_no_state():
    model = make_tiny_model("llama")
    seen = []
    c = specdec.costs.profile_verify_cost(
        model,
        widths=(1, 3, 6),
        contexts=(16, 40),
        repeats=1,
        progress=lambda done, total, label: seen.append((done, total)),
    )
    assert c.widths == (1, 3, 6) and c.contexts == (16, 40)
    assert all(len(r) == 3 and list(r) == sorted(r) and r[0] > 0 for r in c.seconds)
    assert seen[-1] == (2 * 3 * 2, 2 * 3 * 2)  # contexts x widths x (repeats + warm-up)
    assert c.key == model_fingerprint(model)
    with pytest.raises(ValueError, match="widths"):
        specdec.costs.profile_verify_cost(model, widths=(3, 1))


def test_cost_model_profiles_once_then_reads_the_cache(tmp_path, monkeypatch):
    model = make_tiny_model("qwen3")
    calls = []
    real = specdec.costs.profile_verify_cost

    def counting(*a, **k):
        calls.append(k["contexts"])
        return real(*a, **k)

    monkeypatch.setattr(specdec.costs, "profile_verify_cost", counting)
    monkeypatch.setattr(CostModel, "_memory", {})
    opts = dict(widths=(1, 2, 4), contexts=(8, 24), repeats=1, directory=tmp_path)
    m1 = CostModel(model, **opts)
    c1 = m1.curve()
    assert m1.source == "profiled" and m1.path.exists() and len(calls) == 1
    assert CostModel(model, **opts).curve() == c1  # same process: from memory
    monkeypatch.setattr(CostModel, "_memory", {})
    m3 = CostModel(model, **opts)
    assert m3.curve() == c1 and m3.source == "disk" and len(calls) == 1
    # A request that ran past twice the longest profiled context profiles a longer one.
    m3.note_context(30)
    assert m3.refresh() is False
    m3.note_context(100)
    assert m3.refresh() is True and m3.curve().contexts[-1] == 100 and len(calls) == 2
    assert m3.source == "refreshed" and m3.stats()["contexts"] == [8, 24, 100]
    # Another pipeline of the process takes that longer curve instead of measuring its own.
    m5 = CostModel(model, **opts)
    m5._curve, m5.source = c1, "disk"  # loaded before m3 refreshed
    m5.note_context(90)
    assert m5.refresh() is False and m5.curve() is m3.curve() and len(calls) == 2
    assert m5.source == "memory" and m5.cost(4, 100) == m3.cost(4, 100)
    m5.note_context(1000)  # past twice what the shared curve reaches: profiled
    assert m5.refresh() is True and m5.curve().contexts[-1] == 1000 and len(calls) == 3
    # Another width set is another cache entry.
    assert CostModel(model, **{**opts, "widths": (1, 3)}).path != m1.path
    # A curve cached in format 1 (medians of two forwards) is profiled again.
    old = json.loads(m3.path.read_text())
    m3.path.write_text(json.dumps({**old, "format": 1}))
    monkeypatch.setattr(CostModel, "_memory", {})
    m4 = CostModel(model, **opts)
    m4.curve()
    assert m4.source == "profiled" and len(calls) == 4
    assert json.loads(m4.path.read_text())["format"] == 2


def test_a_profile_cell_is_the_fastest_of_its_forwards(monkeypatch):
    # A clock that makes every second forward of a cell slow (another job running):
    # the cell keeps the fast ones.
    ticks = iter(range(10**6))
    slow = {"n": 0}

    def clock():
        return next(ticks) * 1.0

    real_verify = specdec.verifiers.LogitsVerifier.verify

    def verify(self, model, tokens, caches, *a, **k):
        slow["n"] += 1
        if slow["n"] % 2 == 0:
            next(ticks)  # this forward "takes" 1 s longer
        return real_verify(self, model, tokens, caches, *a, **k)

    monkeypatch.setattr(specdec.verifiers.LogitsVerifier, "verify", verify)
    monkeypatch.setattr(specdec.costs.time, "perf_counter", clock)
    c = specdec.costs.profile_verify_cost(make_tiny_model("llama"), widths=(1, 2), contexts=(8,))
    assert c.seconds == ((1.0, 1.0),)


def test_cost_model_with_a_given_curve_never_profiles(tmp_path, monkeypatch):
    def fail(*a, **k):
        raise AssertionError("profiled")

    monkeypatch.setattr(specdec.costs, "profile_verify_cost", fail)
    given = curve([(1.0, 2.0, 4.0, 8.0), (2.0, 3.0, 5.0, 13.0)])
    m = CostModel(make_tiny_model("llama"), curve=given, directory=tmp_path)
    m.note_context(10**6)
    assert m.curve() is given and m.refresh() is False and m.cost(8, 1000) == 13.0


def test_round_overheads_read_in_quarter_steps_move_only_past_a_whole_quarter():
    o = specdec.costs.RoundOverhead()
    extra = {"d": 0.093}
    o.extra_s = lambda drafter=None: extra.get(drafter, 0.0)
    step = 0.1  # seconds of a one-token step
    assert o.steady_steps("d") == {"round": None, "drafted": None}
    o.baseline_s = 0.004
    assert o.steady("d", step, 0.25) == pytest.approx((0.0, 0.1))
    assert o.steady_steps("d") == {"round": 0.0, "drafted": 1.0}
    # within one quarter step of the multiples in use (either side): unchanged
    o.baseline_s, extra["d"] = 0.02, 0.08
    assert o.steady("d", step, 0.25) == pytest.approx((0.0, 0.1))
    o.baseline_s, extra["d"] = -0.02, 0.124
    assert o.steady("d", step, 0.25) == pytest.approx((0.0, 0.1))
    # more than a quarter step away: the nearest multiple
    o.baseline_s, extra["d"] = 0.03, 0.07
    assert o.steady("d", step, 0.25) == pytest.approx((0.025, 0.075))
    # The multiples are of a step: at a step twice as dear the same seconds are 0.15
    # and 0.35 steps, within a quarter of 0.25 steps and past one of 0.75 steps.
    assert o.steady("d", 0.2, 0.25) == pytest.approx((0.05, 0.05))
    # Each drafter has its own multiples; 0 (or no step cost): the estimates as they are.
    assert o.steady("e", step, 0.25) == pytest.approx((0.025, 0.0))
    assert o.steady("d", step, 0.0) == (0.03, 0.07)
    assert o.steady("d", 0.0, 0.25) == (0.03, 0.07)


def test_the_pipelines_of_a_bench_share_one_round_overhead():
    from types import SimpleNamespace

    from specdec.bench.runner import share_round_overhead

    model = make_tiny_model("llama")
    a, b, c, d = (CostModel(model, persist=False) for _ in range(4))
    other = CostModel(model, widths=(1, 2), persist=False)  # another curve: its own
    pipes = [SimpleNamespace(cost_model=m) for m in (a, b, None, other, c)]
    assert a.overhead is not b.overhead
    assert share_round_overhead(pipes) == 2
    assert b.overhead is a.overhead and c.overhead is a.overhead
    assert other.overhead is not a.overhead and d.overhead is not a.overhead
    b.overhead.observe("drafted", 0.5, 1.0, "x")  # learnt by b: read by a and c too
    assert a.overhead.rounds["drafted"] == c.overhead.rounds["drafted"] == 1


# -- choosing a block --------------------------------------------------------------


def test_best_block_maximises_tokens_per_second():
    def flat(w):
        return 1.0

    def linear(w):
        return float(w)

    def gentle(w):
        return 1.0 + 0.1 * (w - 1)

    assert specdec.costs.best_block([1.0] * 8, flat).size == 8
    assert specdec.costs.best_block([0.0] * 8, gentle).size == 0
    # Cost proportional to width: no block beats a plain step unless every token lands.
    assert specdec.costs.best_block([0.9, 0.9], linear).size == 0
    c = specdec.costs.best_block([0.9, 0.9], gentle)
    assert c.size == 2
    assert c.expected_tokens == pytest.approx(1 + 0.9 + 0.81)
    assert c.rate == pytest.approx(2.71 / 1.2) and c.gain == pytest.approx(2.71 / 1.2)
    # Position 3 is a coin flip at a steep extra cost: stop before it.
    assert specdec.costs.best_block([1.0, 1.0, 0.1], lambda w: 1.0 + (w > 3) * 5.0).size == 2
    assert specdec.costs.best_block([1.0] * 8, flat, max_size=3).size == 3
    # Equal rates: the smaller block.
    assert specdec.costs.best_block([0.0, 1.0], flat).size == 0
    # Drafting time counts.
    assert specdec.costs.best_block([0.5] * 4, flat, draft_cost=lambda k: k * 10.0).size == 0


def test_acceptance_estimate_counts_reached_and_accepted_positions():
    e = specdec.costs.AcceptanceEstimate(4, prior_weight=0.0, decay=1.0)
    e.observe(4, 2)  # positions 1, 2 accepted, 3 rejected, 4 never reached
    e.observe(2, 2)
    assert e.reached == [2.0, 2.0, 1.0, 0.0] and e.accepted == [2.0, 2.0, 0.0, 0.0]
    assert e.probs(3) == [1.0, 1.0, 0.0]
    assert e.pooled() == pytest.approx((4 + 0.5) / (5 + 1))
    shrunk = specdec.costs.AcceptanceEstimate(4, prior_weight=2.0, decay=1.0)
    shrunk.observe(4, 2)
    p = shrunk.pooled()
    assert shrunk.probs()[3] == pytest.approx(p)  # unreached: the pooled rate
    assert shrunk.probs()[2] == pytest.approx((0 + 2 * p) / (1 + 2))
    decayed = specdec.costs.AcceptanceEstimate(2, decay=0.5)
    decayed.observe(1, 1)
    decayed.observe(1, 0)
    assert decayed.reached[0] == pytest.approx(1.5) and decayed.accepted[0] == pytest.approx(0.5)
    assert decayed.to_dict(2)["outcomes"] == 2
    with pytest.raises(ValueError):
        specdec.costs.AcceptanceEstimate(4, decay=0.0)


def test_acceptance_estimate_learns_an_outcome_in_parts():
    # A proposal scored as the target commits: 3 tokens matched after one round,
    # then the 5th differed. Learnt in two parts, it is one outcome of 4 accepted.
    whole = specdec.costs.AcceptanceEstimate(6, decay=0.5)
    parts = specdec.costs.AcceptanceEstimate(6, decay=0.5)
    for e in (whole, parts):
        e.observe(6, 6)  # an earlier outcome, so the decay shows
    whole.observe(6, 4)
    parts.observe(3, 3)
    parts.observe(6, 4, start=3)
    assert parts.reached == whole.reached and parts.accepted == whole.accepted
    assert parts.outcomes == whole.outcomes == 2
    assert parts.reached[4] == pytest.approx(1.5) and parts.accepted[4] == pytest.approx(0.5)
    parts.observe(3, 3, start=3)  # nothing after the start: nothing learnt
    assert parts.reached == whole.reached


def test_round_overhead_learns_what_a_drafted_round_costs_beyond_its_forward():
    o = specdec.costs.RoundOverhead(prior_s=0.5, prior_rounds=1.0, decay=1.0, alpha=0.5)
    assert o.extra_s("ngram_copy") == 0.5 and o.baseline_s == 0.0  # the prior
    o.observe("plain", 0.2, step_s=10.0)
    o.observe("plain", 0.2, step_s=10.0)
    assert o.baseline_s == pytest.approx(0.15)  # an average from 0, not the first sample
    # One drafted round (excess 3) and the two plain steps after it that were not
    # pipelined (excess 1 each): all of it is the drafted round's cost, less the
    # baseline (the baseline as it is when read, not as it was at each round).
    o.observe("drafted", 3.0, step_s=10.0, drafter="ngram_copy")
    o.observe("after_draft", 1.0, step_s=10.0, drafter="ngram_copy")
    o.observe("after_draft", 1.0, step_s=10.0, drafter="ngram_copy")
    assert o.extra_s("ngram_copy") == pytest.approx(((3 + 1 + 1 - 3 * 0.15) + 0.5) / 2)
    o.observe("plain", 0.15, step_s=10.0)
    assert o.extra_s("ngram_copy") == pytest.approx(((3 + 1 + 1 - 3 * 0.15) + 0.5) / 2)
    o.observe("plain", 0.35, step_s=10.0)  # the baseline moves to 0.25
    assert o.extra_s("ngram_copy") == pytest.approx(((3 + 1 + 1 - 3 * 0.25) + 0.5) / 2)
    # Each drafter has its own: another's rounds (a head's forward inside) are not ours.
    o.observe("drafted", 9.0, step_s=10.0, drafter="qwen_mtp")
    assert o.extra_s("qwen_mtp") > o.extra_s("ngram_copy")
    assert o.extra_s("ngram_copy") == pytest.approx(((3 + 1 + 1 - 3 * 0.25) + 0.5) / 2)
    d = o.to_dict()
    assert d["rounds"] == {"plain": 4, "drafted": 2, "after_draft": 2}
    assert d["extra_ms"]["ngram_copy"] == pytest.approx(1e3 * o.extra_s("ngram_copy"), abs=1e-3)
    # A pause of the process counts as one step at most (half a step below); a round
    # that costs less than the baseline gives no negative overhead.
    c = specdec.costs.RoundOverhead(prior_rounds=1e-9, decay=1.0)
    c.observe("drafted", 50.0, step_s=2.0)
    assert c.extra_s() == pytest.approx(2.0)
    c.observe("plain", -50.0, step_s=2.0)
    assert c.baseline_s == pytest.approx(0.05 * -1.0)
    neg = specdec.costs.RoundOverhead()
    neg.observe("drafted", -0.5, step_s=2.0)
    assert neg.extra_s() == 0.0
    # Decay, per round of any kind: newer rounds weigh more, and while nothing is
    # drafted the estimate relaxes towards the prior (drafting gets measured again).
    d = specdec.costs.RoundOverhead(prior_rounds=1e-9, decay=0.5)
    d.observe("drafted", 1.0, step_s=10.0)
    d.observe("drafted", 3.0, step_s=10.0)
    assert d.extra_s() == pytest.approx((0.5 * 1 + 3) / 1.5)
    r = specdec.costs.RoundOverhead(prior_s=0.0, prior_rounds=1.0, decay=0.9, alpha=1e-9)
    r.observe("drafted", 5.0, step_s=10.0)
    high = r.extra_s()
    for _ in range(60):
        r.observe("plain", 0.0, step_s=10.0)
    assert r.extra_s() < 0.01 * high
    with pytest.raises(ValueError, match="round kind"):
        o.observe("pipelined", 1.0, step_s=1.0)
    with pytest.raises(ValueError):
        specdec.costs.RoundOverhead(decay=0.0)


def test_a_drafted_rounds_overhead_can_make_a_weak_block_not_pay():
    # A one-token block accepted a quarter of the time, verified for 12% more than a
    # step: it pays on the curve alone, not once a drafted round costs 0.3 steps more.
    def cost(w):
        return 1.0 if w == 1 else 1.12

    assert specdec.costs.best_block([0.26], cost).size == 1
    assert specdec.costs.best_block([0.26], cost, draft_cost=lambda k: 0.3).size == 0
    # ... while a long block that lands keeps paying.
    assert specdec.costs.best_block([0.9] * 8, cost, draft_cost=lambda k: 0.3).size == 8
    # The baseline every round pays (overhead_s) counts on both sides.
    cm = CostModel(None, curve=curve([(1.0, 1.12, 1.2, 1.3), (1.0, 1.12, 1.2, 1.3)]))
    cm.overhead = specdec.costs.RoundOverhead(decay=1.0, prior_rounds=1.0)
    for _ in range(200):
        cm.observe_round("plain", 1, 100, 1.1)  # excess 0.1
    for _ in range(20):
        cm.observe_round("drafted", 2, 100, 1.12 + 0.1 + 0.3, "d")  # 0.3 beyond that
    assert cm.round_overhead_s == pytest.approx(0.1, abs=1e-3)
    assert cm.draft_overhead_s("d") == pytest.approx(0.3 * 20 / 21, abs=1e-3)
    assert cm.draft_overhead_s("other") == 0.0
    assert cm.stats()["round_overhead"]["rounds"]["drafted"] == 20
    CostModel(None, curve=None, persist=False).observe_round("drafted", 2, 1, 9.0)  # no curve


# -- shadow scoring ----------------------------------------------------------------


def test_shadow_score_follows_the_rounds_after_it():
    s = specdec.shadow.ShadowScore(10, [1, 2, 3, 4])
    assert not s.feed(10, [1])  # a plain step: one token matched
    assert not s.feed(11, [2, 3]) and s.matched == 3
    assert s.feed(13, [9, 9]) and s.outcome() == (4, 3) and not s.full
    full = specdec.shadow.ShadowScore(0, [5, 6])
    assert full.feed(0, [5, 6, 7]) and full.full and full.outcome() == (2, 2)
    wrong = specdec.shadow.ShadowScore(0, [5, 6])
    assert wrong.feed(0, [4]) and wrong.outcome() == (2, 0)
    gap = specdec.shadow.ShadowScore(0, [5, 6])
    assert gap.feed(3, [6]) and gap.lost
    late = specdec.shadow.ShadowScore(5, [7])
    assert late.feed(3, [1, 2, 7]) and late.full  # a round that began before it


# -- the pipeline ------------------------------------------------------------------


class _Copy(specdec.BaseDrafter):
    """Proposes the next reference tokens; cheap, so it answers shadow() too."""

    name = "shadowy"
    uses_verify_cost = True

    def __init__(self, reference=()):
        self.reference = list(reference)
        self.contexts = []

    def session(self, ctx):
        outer = self
        outer.contexts.append(ctx)

        class S(specdec.BaseDrafterSession):
            shadowed = 0

            def propose(self, history, max_len):
                n = len(history)
                toks = outer.reference[n : n + max_len]
                return specdec.Draft(tokens=toks) if toks else None

            def shadow(self, history, max_len):
                S.shadowed += 1
                return self.propose(history, max_len)

        return S()


class _Refuser(specdec.BaseGovernor):
    """Refuses every other round and records the shadows it is shown."""

    name = "refuser"

    def __init__(self):
        self.seen = []

    def session(self, ctx):
        outer = self

        class G(specdec.BaseGovernorSession):
            n = 0

            def budget(self, drafter, max_len):
                G.n += 1
                return 0 if G.n % 2 else max_len

            def observe_round(self, result):
                outer.seen.append((result.start_position, dict(result.shadows), result.committed))

        return G()


def _plugin(drafter_factory, **governors):
    """A plugin that registers ``drafter_factory`` as the drafter ``shadowy`` and each
    governor instance under its keyword."""

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("shadowy", drafter_factory)

        @specdec.hookimpl
        def specdec_register_governors(self, register):
            for name, governor in governors.items():
                register(name, lambda g=governor: g)

    return P()


def test_pipeline_shadows_refused_drafters_and_hands_out_the_cost_model(monkeypatch):
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = prompt + specdec.assemble(model, policy="none").generate(prompt, max_tokens=24).tokens
    drafter, governor = _Copy(ref), _Refuser()
    given = curve([(1.0, 1.1, 1.2, 1.3), (1.0, 1.1, 1.2, 1.3)])

    with plugin_host(_plugin(lambda: drafter, refuser=governor), load_entry_points=False) as host:
        pipe = specdec.assemble(
            model, policy={"drafters": ["shadowy"], "governor": "refuser"}, host=host
        )
        assert isinstance(pipe.cost_model, CostModel)
        pipe.cost_model = CostModel(model, curve=given)
        out = pipe.generate(prompt, max_tokens=24)
    assert out.tokens == ref[len(prompt) :]
    st = out.stats
    assert drafter.contexts[-1].cost is pipe.cost_model
    assert st.verify_cost["source"] == "given"
    shadowed = [(p, sh, c) for p, sh, c in governor.seen if sh]
    assert shadowed and st.shadow_proposals == len(shadowed)
    for pos, sh, committed in shadowed:
        # What the drafter would have proposed at that position: the reference from there on.
        assert sh["shadowy"] == tuple(ref[pos : pos + len(sh["shadowy"])])
        assert committed[0] == sh["shadowy"][0]
    assert st.shadow_time_s > 0 and 0 < st.shadow_fraction < 1
    assert sum(st.block_sizes.values()) == st.target_forwards
    assert st.block_sizes.get(0, 0) == st.rounds_without_draft > 0
    assert st.accepted > 0
    # Every round told the cost model its wall time and kind but a refused first one
    # and the last two (no step is queued ahead there): the refused rounds follow a
    # drafted one (not pipelined), none was queued ahead.
    seen = st.verify_cost["round_overhead"]["rounds"]
    assert seen["drafted"] == st.rounds_with_draft > 0 and seen["plain"] == 0
    assert seen["after_draft"] >= st.rounds_without_draft - 3
    assert pipe.cost_model.overhead.rounds == seen


class _Sometimes(specdec.BaseGovernor):
    """Lets the drafter draft in the rounds numbered in ``rounds`` (1-based) only."""

    name = "sometimes"

    def __init__(self, rounds):
        self.rounds = set(rounds)

    def session(self, ctx):
        outer = self

        class G(specdec.BaseGovernorSession):
            wants_shadows = False
            n = 0

            def budget(self, drafter, max_len):
                G.n += 1
                return max_len if G.n in outer.rounds else 0

        return G()


def test_the_loop_tells_the_cost_model_each_rounds_kind_without_the_consumers_time():
    import time

    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    n_tok = 40
    ref = prompt + specdec.assemble(model, policy="none").generate(prompt, max_tokens=n_tok).tokens
    drafter, governor = _Copy(ref), _Sometimes({3, 15, 27})
    # One step costs 30 ms on this curve (a tiny model's take about 1 ms): a plain
    # step's excess is clipped at half a step below, -15 ms, unless the consumer's
    # 20 ms of sleep per token were counted in the round times.
    given = curve([(0.03, 0.031, 0.032, 0.033), (0.03, 0.031, 0.032, 0.033)])

    with plugin_host(_plugin(lambda: drafter, sometimes=governor), load_entry_points=False) as host:
        pipe = specdec.assemble(
            model,
            policy={"drafters": ["shadowy"], "governor": "sometimes", "max_block": 2},
            host=host,
        )
        pipe.cost_model = CostModel(model, curve=given)
        pipe.cost_model.overhead = specdec.costs.RoundOverhead(alpha=1.0)  # the last plain step
        tokens = []
        for r in pipe.stream(prompt, max_tokens=n_tok):
            tokens.append(r.token)
            time.sleep(0.02)
    assert tokens == ref[len(prompt) :]
    st = r.stats
    seen = pipe.cost_model.overhead.rounds
    assert seen["drafted"] == st.rounds_with_draft == 3 and st.accepted > 0
    # After each drafted round: the three steps run before one is queued ahead again,
    # and that first one queued ahead; every other queued step is a plain one.
    assert seen["after_draft"] == 3 * 4
    assert seen["plain"] == st.lookahead_rounds - 3 > 0
    assert pipe.cost_model.overhead.baseline_s == pytest.approx(-0.015)
    assert set(st.verify_cost["round_overhead"]["extra_ms"]) == {"shadowy"}


def test_no_cost_model_without_a_drafter_that_reads_it():
    model = make_tiny_model("llama")
    assert specdec.assemble(model, policy="none").cost_model is None

    class NoCost(_Copy):
        uses_verify_cost = False

    with plugin_host(_plugin(NoCost), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["shadowy"]}, host=host)
        assert pipe.cost_model is None
        out = pipe.generate([1, 2, 3], max_tokens=4)
    assert out.stats.verify_cost == {} and out.stats.shadow_proposals == 0


def test_a_curve_that_cannot_be_profiled_does_not_fail_the_request(monkeypatch):
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = prompt + specdec.assemble(model, policy="none").generate(prompt, max_tokens=12).tokens
    drafter = _Copy(ref)

    def broken(*a, **k):
        raise RuntimeError("no memory for the profile")

    with plugin_host(_plugin(lambda: drafter), load_entry_points=False) as host:
        pipe = specdec.assemble(model, policy={"drafters": ["shadowy"]}, host=host)
        pipe.cost_model = CostModel(model, persist=False)
        monkeypatch.setattr(CostModel, "_memory", {})
        monkeypatch.setattr(specdec.costs, "profile_verify_cost", broken)
        out = pipe.generate(prompt, max_tokens=12)
    assert out.tokens == ref[len(prompt) :]
    assert "no memory for the profile" in out.stats.verify_cost["failure"]
    assert drafter.contexts[-1].cost is None  # the drafter was told there is no curve
    assert out.stats.accepted > 0


def test_no_shadow_proposals_for_a_governor_that_reads_none():
    model = make_tiny_model("llama", vocab_size=64)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    ref = prompt + specdec.assemble(model, policy="none").generate(prompt, max_tokens=16).tokens
    drafter, governor = _Copy(ref), _Refuser()

    class Blind(_Refuser):
        def session(self, ctx):
            s = super().session(ctx)
            s.wants_shadows = False
            return s

    governor = Blind()

    with plugin_host(_plugin(lambda: drafter, blind=governor), load_entry_points=False) as host:
        pipe = specdec.assemble(
            model, policy={"drafters": ["shadowy"], "governor": "blind"}, host=host
        )
        pipe.cost_model = CostModel(
            model, curve=curve([(1.0, 1.1, 1.2, 1.3), (1.0, 1.1, 1.2, 1.3)])
        )
        out = pipe.generate(prompt, max_tokens=16)
    assert out.tokens == ref[len(prompt) :]
    assert out.stats.rounds_without_draft > 0  # the governor did refuse rounds
    assert out.stats.shadow_proposals == 0 and not any(sh for _, sh, _ in governor.seen)


def test_prepare_profiles_the_context_a_server_expects(tmp_path, monkeypatch):
    """pipe.prepare(context=N) measures the curve to N now (a server at startup) rather
    than in the first request that gets there; a context the curve already covers to
    half is not measured again."""
    model = make_tiny_model("llama")
    monkeypatch.setattr(CostModel, "_memory", {})
    pipe = specdec.assemble(model, None, "ngram")
    pipe.cost_model = CostModel(model, widths=(1, 2, 4), contexts=(8, 24), directory=tmp_path)
    pipe.prepare(context=40)  # <= twice 24: the profiled contexts are enough
    assert pipe.cost_model.stats()["contexts"] == [8, 24]
    pipe.prepare(context=200)
    assert pipe.cost_model.stats()["contexts"] == [8, 24, 200]
    assert pipe.cost_model.source == "refreshed" and pipe.cost_model.path.exists()
    with pytest.raises(specdec.RequestError, match="context must be an integer >= 1"):
        pipe.prepare(context=0)
