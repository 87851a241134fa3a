"""Batch-aware sizing: the verify cost of a batch's forward, the width that pays for every
row (best_width), drafts' acceptance estimates, and a batch cutting its rows' blocks."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec.costs import CostModel, VerifyCostCurve, best_width, profile_verify_cost
from specdec.errors import DraftError
from specdec.testing import copy_heavy_prompt, make_tiny_model


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def prompts(llama):
    """Copy-heavy prompts of different lengths."""
    return [copy_heavy_prompt(llama, [3 + i, 9, 4 + 2 * i, 17], n=12 + 7 * i) for i in range(4)]


def _curve(per_token: float, rows: int = 1, widths=(1, 2, 4, 8, 17)) -> VerifyCostCurve:
    """A curve where a forward costs 1 + per_token * (width - 1) seconds."""
    row = tuple(1.0 + per_token * (w - 1) for w in widths)
    return VerifyCostCurve(widths=widths, contexts=(10,), seconds=(row,), rows=rows)


# -- best_width ---------------------------------------------------------------------


def test_best_width_widens_only_when_the_forward_pays_for_every_row():
    sure = [0.95] * 8
    plain: list[float] = []
    # a forward of 9 tokens a row costs 3 steps: for one row with a sure block among
    # seven plain rows it does not pay (8 + 6.6 tokens in 3 steps against 8 in one) ...
    steep = best_width([sure] + [plain] * 7, lambda w: 1.0 + 0.25 * (w - 1))
    assert steep.size == 0 and steep.gain == pytest.approx(1.0)
    # ... for eight such rows it does
    all_rows = best_width([sure] * 8, lambda w: 1.0 + 0.25 * (w - 1))
    assert all_rows.size == 8 and all_rows.gain > 2
    # a cheap forward: the one row's block pays for the batch
    flat = best_width([sure] + [plain] * 7, lambda w: 1.0 + 0.01 * (w - 1))
    assert flat.size == 8
    # rows whose blocks may not be cut keep the forward at least that wide
    least = best_width([sure] + [plain] * 7, lambda w: 1.0 + 0.25 * (w - 1), least=4)
    assert least.size == 3
    # the expected tokens: every row's bonus token plus its accepted drafts
    one = best_width([[0.5, 0.5]], lambda w: 1.0)
    assert one.size == 2 and one.expected_tokens == pytest.approx(1 + 0.5 + 0.25)
    assert best_width([], lambda w: 1.0).size == 0


# -- the curve of a batch -----------------------------------------------------------------


def test_batch_curves_are_profiled_once_per_size_cached_and_interpolated(
    llama, tmp_path, monkeypatch
):
    monkeypatch.setattr(CostModel, "_memory", {})
    cm = CostModel(llama, widths=(1, 2, 4), contexts=(8, 24), repeats=1, directory=tmp_path)
    profiled = []
    real = specdec.costs.profile_verify_cost

    def counting(*args, **kwargs):
        profiled.append(kwargs.get("rows", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(specdec.costs, "profile_verify_cost", counting)
    two, four = cm.batch_curve(2), cm.batch_curve(4)
    assert (two.rows, four.rows) == (2, 4) and two.contexts == (8, 24)
    assert profiled == [2, 4]
    assert cm.batch_cost(3, 4, 16) == pytest.approx((two.cost(4, 16) + four.cost(4, 16)) / 2)
    assert cm.batch_cost(4, 2, 16) == four.cost(2, 16)
    assert cm.stats()["batch_rows"] == [2, 4]
    files = sorted(p.name for p in (tmp_path / "verify-cost").iterdir())
    assert len(files) == 2 and all("-b2-" in f or "-b4-" in f for f in files)
    with pytest.raises(ValueError, match="powers of two"):
        cm.batch_curve(3)
    # another process: read from disk, not profiled again
    monkeypatch.setattr(CostModel, "_memory", {})
    again = CostModel(llama, widths=(1, 2, 4), contexts=(8, 24), repeats=1, directory=tmp_path)
    assert again.batch_curve(4) == four and profiled == [2, 4]
    saved = json.loads((tmp_path / "verify-cost" / files[1]).read_text())
    assert saved["rows"] in (2, 4)
    # a given curve prices only the batches given with it
    given = CostModel(llama, curve=_curve(0.1), batch_curves={2: _curve(0.5, rows=2)})
    assert given.batch_cost(2, 3, 10) == pytest.approx(2.0) and given.batch_cost(4, 3, 10) is None
    assert profiled == [2, 4]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_batch_profile_times_rows_through_the_batch_rollbacks(arch):
    model = make_tiny_model(arch)
    c = profile_verify_cost(model, widths=(1, 3), contexts=(12,), repeats=1, rows=3)
    assert c.rows == 3 and all(x > 0 for x in c.seconds[0])
    with pytest.raises(ValueError, match="rows"):
        profile_verify_cost(model, rows=0)


def test_a_failed_batch_profile_leaves_blocks_as_proposed(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(CostModel, "_memory", {})
    cm = CostModel(llama, widths=(1, 2), contexts=(8,), repeats=1, directory=tmp_path)

    def broken(*args, **kwargs):
        raise RuntimeError("no memory left")

    monkeypatch.setattr(specdec.costs, "profile_verify_cost", broken)
    assert cm.batch_cost(2, 2, 8) is None
    assert "no memory left" in cm.batch_failure and cm.stats()["batch_failure"]


# -- drafts' acceptance estimates -------------------------------------------------------


def test_a_drafts_acceptance_must_be_one_probability_per_token(llama):
    class Bad(specdec.BaseDrafter):
        name = "bad_estimates"

        def __init__(self, acceptance):
            self.acceptance = acceptance

        def session(self, ctx):
            return BadSession(self.acceptance)

    class BadSession(specdec.BaseDrafterSession):
        def __init__(self, acceptance):
            self.acceptance = acceptance

        def propose(self, history, max_len):
            return specdec.Draft(tokens=[1, 2], acceptance=self.acceptance)

    for wrong in ([0.5], [0.5, 1.5], [0.5, float("nan")]):
        with specdec.testing.plugin_host(_DrafterPlugin(Bad(wrong))):
            pipe = specdec.assemble(llama, None, specdec.Policy(drafters=("bad_estimates",)))
            with pytest.raises(DraftError, match="acceptance must be 2 floats in \\[0, 1\\]"):
                pipe.generate([1, 2, 3], max_tokens=4)
    with pytest.raises(TypeError, match="acceptance"):
        specdec.Draft(tokens=[1], acceptance="high")
    assert specdec.Draft(tokens=[1, 2], acceptance=[1, 0.5]).acceptance == (1.0, 0.5)


class _DrafterPlugin:
    def __init__(self, drafter):
        self.drafter = drafter

    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register(self.drafter.name, lambda **opts: self.drafter)


# -- a batch sizing its rows --------------------------------------------------------------


def _pipe(llama, batch_per_token: float, sizing: str = "width"):
    """The copy policy priced by given curves: a single row's wide forward cheap, a batch
    forward ``batch_per_token`` seconds per token fed per row."""
    pol = specdec.Policy(name="copy-sized", drafters=("ngram_copy",), batch_sizing=sizing)
    pipe = specdec.assemble(llama, None, pol)
    batch = {n: _curve(batch_per_token, rows=n) for n in (2, 4)}
    pipe.cost_model = CostModel(llama, curve=_curve(0.02), batch_curves=batch)
    return pipe


def _run(pipe, prompts, max_tokens=30):
    batch = pipe.batch(4)
    for p in prompts:
        batch.add(p, max_tokens=max_tokens)
    out, last = {}, {}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            if not ev.response.is_stop_token:
                out.setdefault(ev.row, []).append(ev.response.token)
            last[ev.row] = ev.response.stats
    return batch, [out[r] for r in sorted(out)], [last[r] for r in sorted(last)]


def test_a_batch_cuts_blocks_to_the_width_that_pays_for_every_row(llama, prompts):
    plain = specdec.assemble(llama, None, "none")
    alone = [plain.generate(p, max_tokens=30).tokens for p in prompts]
    # A batch forward whose cost grows by a tenth of a step per token fed per row (a
    # row alone: a fiftieth): a row's long block slows every row down, so the batch
    # keeps the forward narrower than the rows' blocks unless they pay for it.
    steep, rows, stats = _run(_pipe(llama, 0.1), prompts)
    assert rows == alone
    assert sum(s.batch_cut for s in stats) > 0 and sum(s.accepted for s in stats) > 0
    # where it is cheap, the rows' blocks are verified as their drafter sized them
    flat, rows, stats = _run(_pipe(llama, 0.001), prompts)
    assert rows == alone
    assert sum(s.batch_cut for s in stats) == 0 and sum(s.accepted for s in stats) > 0
    mean = lambda b: sum(w * n for w, n in b.widths[4].items()) / sum(b.widths[4].values())  # noqa: E731
    assert mean(steep) < mean(flat)
    # batch_sizing = "rows": blocks as sized alone, however steep the batch's curve
    rowwise, rows, stats = _run(_pipe(llama, 0.5, sizing="rows"), prompts)
    assert rows == alone and sum(s.batch_cut for s in stats) == 0


def test_batch_sizing_is_a_checked_policy_key():
    assert specdec.Policy.from_dict({"batch_sizing": "rows"}).batch_sizing == "rows"
    with pytest.raises(specdec.PolicyError, match="batch_sizing must be one of"):
        specdec.Policy(batch_sizing="auto")


def test_prepare_loads_the_curves_of_the_batches_to_come(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(CostModel, "_memory", {})
    pipe = specdec.assemble(llama, None, "ngram")
    pipe.cost_model = CostModel(
        llama, widths=(1, 2, 4), contexts=(8,), repeats=1, directory=tmp_path
    )
    pipe.prepare(rows=3)
    assert pipe.cost_model.stats()["batch_rows"] == [2, 4]
    with pytest.raises(specdec.RequestError, match="rows must be an integer >= 1"):
        pipe.prepare(rows=0)


def test_a_batch_never_cuts_a_grammars_forced_tokens(tmp_path):
    """A batch forward so dear that no drafted token pays still verifies the tokens a
    row's grammar forces (certain to be accepted): they are never cut, and every forced
    token counted was verified and accepted."""
    from core_support import write_json_tokenizer

    tok = write_json_tokenizer(tmp_path, 320)
    model = make_tiny_model("llama", vocab_size=320)
    prompt = tok.encode('Alice lives in Portland. {"name":"Alice","city":"Portland"}')
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "city": {"enum": ["Paris"]}},
        "required": ["name", "city"],
        "additionalProperties": False,
    }
    pol = specdec.Policy(name="copy-forced", drafters=("ngram_copy",), forced_drafts=True)
    pipe = specdec.assemble(model, tok, pol)
    steep = {n: _curve(1.0, rows=n) for n in (2, 4)}
    pipe.cost_model = CostModel(model, curve=_curve(0.02), batch_curves=steep)
    plain = specdec.assemble(model, tok, "none")
    batch = pipe.batch(3)
    rows = [batch.add(prompt[i:], max_tokens=30, grammar={"json_schema": schema}) for i in range(3)]
    got: dict[int, list[int]] = {r: [] for r in rows}
    stats = {}
    while len(batch):
        for ev in batch.step():
            assert ev.error is None, ev.error
            if not ev.response.is_stop_token:
                got[ev.row].append(ev.response.token)
            stats[ev.row] = ev.response.stats
    for i, r in enumerate(rows):
        alone = plain.generate(prompt[i:], max_tokens=30, grammar={"json_schema": schema})
        assert got[r] == alone.tokens
        s = stats[r]
        assert 0 < s.grammar["forced"] <= s.accepted
