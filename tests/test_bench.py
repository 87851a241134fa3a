"""``specdec bench`` and :mod:`specdec.bench` on a tiny random model (nothing is timed).

The model folder holds a 2-layer llama with random weights and a byte-level
BPE tokenizer, so the shipped workloads' real text encodes as it is. The CLI runs in-process through ``specdec.cli.main``.
"""

from __future__ import annotations

import io
import json
import re
from importlib import resources
from pathlib import Path

import attrs
import pytest
import specdec
from core_support import tiny_config, write_random_llama
from specdec.bench import (
    RECORD_FIELDS,
    SHORT_ANSWER_TOKENS,
    Progress,
    RunSample,
    WorkloadResult,
    faithfulness,
    get_workloads,
    load_workloads,
    parse_sweep,
    policy_pairs,
    run_bench,
    spec_baseline_table,
    sweep_policies,
    total_steps,
    workload_names,
)
from specdec.bench import command as bench_command
from specdec.cli import main

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
EOS = "<|endoftext|>"
FAST = ("--runs", "1", "--max-tokens", "6")


def write_byte_model(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer llama with random weights and a byte-level BPE tokenizer.

    The tokenizer's merges are learned from the workloads' texts (so prompts stay
    short and tests fast); any text encodes, byte by byte where no merge applies.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [w.request + (w.expected or "") for w in load_workloads().values()]
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    config = dict(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=tok.get_vocab_size(),
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=16384,
    )
    write_random_llama(path, config, seed=seed)
    return path


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("models") / "byte-llama")


@pytest.fixture(scope="module")
def loaded(byte_model):
    from mlx_lm import load

    return load(str(byte_model))


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the bench loads a model before validating its input."""

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was validated")

    import specdec.loading

    monkeypatch.setattr(specdec.loading, "load_model", boom)
    monkeypatch.setattr(specdec, "assemble", boom)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_usage_error(rc: int, out: str, err: str, needle: str) -> None:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("specdec: error: "), err
    assert needle in err, err
    assert out == "", out


# -- workloads -------------------------------------------------------------------


def test_shipped_workloads():
    ws = load_workloads()
    assert list(ws) == [
        "code-edit",
        "code-rewrite",
        "extraction",
        "prose",
        "prose-short",
        "prose-long",
        "follow-up",
        "json-extract",
        "json-form",
    ]
    assert workload_names() == list(ws)
    for w in ws.values():
        assert w.description and w.license and w.template
    code = ws["code-edit"]
    assert 150 <= len(code.source.splitlines()) <= 200
    # one identifier renamed everywhere: the expected answer is exactly that edit
    assert re.search(r"\bfilename\b", code.source) and "file_path" not in code.source
    assert code.expected == re.sub(r"\bfilename\b", "file_path", code.source)
    assert "{source}" in code.template and code.source in code.request
    assert code.expected.startswith(code.answer_prefix.split("\n", 1)[1])
    rewrite = ws["code-rewrite"]
    # a completion (no chat template): the whole file, one identifier renamed
    assert not rewrite.chat_template
    assert 70 <= len(rewrite.source.splitlines()) <= 120
    assert re.search(r"\battrname\b", rewrite.source) and "attr_name" not in rewrite.source
    assert rewrite.expected == re.sub(r"\battrname\b", "attr_name", rewrite.source)
    assert rewrite.request.count(rewrite.source) == 2  # the file, printed twice
    # the grep lines of the prompt are the expected answer's renamed lines
    for i, ln in enumerate(rewrite.expected.split("\n"), 1):
        if "attr_name" in ln:
            assert f"\n{i}:{ln}\n" in rewrite.request
    assert rewrite.request.endswith("\n") and rewrite.answer_prefix
    assert rewrite.expected.startswith(rewrite.answer_prefix + "\n")
    ext = ws["extraction"]
    paragraphs = ext.expected.strip("\n").split("\n\n")
    assert len(paragraphs) == 4
    for p in paragraphs:
        assert p in ext.source  # quoted word for word
        assert p.split(",")[0].split(" (")[0][:30] in ext.template
    assert ext.expected.startswith(ext.answer_prefix)
    prose = ws["prose"]
    assert prose.source == "" and prose.expected is None and prose.faithfulness("x") is None
    assert all(not w.prelude and w.prelude_ids(None) is None for w in (code, rewrite, ext, prose))
    # free prose after prompts of three lengths: nothing to copy
    short, long = ws["prose-short"], ws["prose-long"]
    assert len(short.request) < len(prose.request) < 1000 < len(ext.source) < len(long.request)
    assert long.source == ext.source and "lighthouse keeper" in long.request
    assert all(w.expected is None and not w.default for w in (short, long))
    follow = ws["follow-up"]
    # the second request asks for the prelude's answer again, with one more method
    assert follow.prelude and follow.prelude_request != follow.request
    assert follow.request.startswith(follow.prelude.split(" Reply")[0])
    assert "prelude" in follow.description and follow.expected is None
    assert all(w.grammar is None for w in (code, rewrite, ext, prose, follow))
    jx, jf = ws["json-extract"], ws["json-form"]
    schema = jx.grammar["json_schema"]
    # every text value the answer copies is in the report
    assert set(schema["required"]) == set(schema["properties"]) and len(schema["required"]) == 10
    assert "Northgate Water Treatment Plant" in jx.request and jx.expected is None
    assert jf.source == "" and len(jf.grammar["json_schema"]["required"]) == 11
    for w in (jx, jf):
        specdec.Request(grammar=w.grammar)  # compiles
        assert not w.default  # run when named
    assert all(w.default for w in (code, rewrite, ext, prose, follow))


def test_workload_texts_have_a_notice():
    notice = resources.files("specdec").joinpath("data", "bench", "NOTICE.md").read_text()
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in notice
    for name in ("code-edit-source.txt", "code-rewrite-source.txt", "extraction-source.txt"):
        assert name in notice


def test_get_workloads_selection_and_unknown():
    assert [w.name for w in get_workloads(["prose", "code-edit", "prose"])] == [
        "prose",
        "code-edit",
    ]
    assert len(get_workloads(None)) == 5
    with pytest.raises(specdec.RequestError, match="code-edit, code-rewrite, extraction, prose"):
        get_workloads(["nope"])


# -- faithfulness ----------------------------------------------------------------

EXPECTED = "line one\nline two\nline three\nline four\n"


@pytest.mark.parametrize(
    "output, complete, value",
    [
        (EXPECTED, True, 1.0),
        ("line one\nline two\nline th", False, 1.0),  # cut by max_tokens: fine so far
        ("```python\nline one\nline two\n```\nchatter", False, 0.5),  # fenced, stopped early
        ("line one\nline two\n", True, 0.5),  # stopped early by itself
        ("line one\nline one\nline one\nline one\n", False, 0.25),  # a loop
        ("something else\n", False, 0.0),
        ("line", False, 1.0),  # a partial first line that agrees
        ("lime", False, 0.0),
        (EXPECTED + "extra\nextra\nextra\nextra\n", True, 0.5),  # text past the answer
    ],
)
def test_faithfulness(output, complete, value):
    assert faithfulness(output, EXPECTED, complete=complete) == pytest.approx(value)


def test_workload_faithfulness_counts_the_answer_prefix():
    w = load_workloads()["code-edit"]
    assert w.faithfulness(w.expected[len(w.answer_prefix) - len("```python\n") :]) == 1.0
    w = load_workloads()["code-rewrite"]  # no fence: the prefix is the answer's opening
    assert w.faithfulness(w.expected[len(w.answer_prefix) :]) == 1.0
    assert w.faithfulness(w.expected[len(w.answer_prefix) :], complete=True) == 1.0


# -- the runner ------------------------------------------------------------------


def _ext_workload(text: str) -> specdec.bench.Workload:
    return specdec.bench.Workload(
        name="copy",
        description="copy",
        template="Copy this: {source}",
        source=text,
        expected=text,
        chat_template=False,
    )


def test_run_bench_interleaves_off_and_on(loaded):
    model, tok = loaded
    order = []
    res = run_bench(
        model,
        tok,
        [_ext_workload("abc def abc def abc def\n")],
        runs=3,
        max_tokens=5,
        on_run=lambda kind, w, temp, i: order.append((kind, i)),
    )
    # warm-ups, then the runs: the order rotates run by run
    assert order == [("off", -1), ("on", -1)] + [
        ("off", 0),
        ("on", 0),
        ("on", 1),
        ("off", 1),
        ("off", 2),
        ("on", 2),
    ]
    (r,) = res
    assert len(r.off) == len(r.on) == 3
    assert r.identical is True
    assert list(r.record()) == list(RECORD_FIELDS)


def test_run_bench_runs_the_prelude_before_every_run(loaded, monkeypatch):
    from specdec.bench import runner

    model, tok = loaded
    w = attrs.evolve(_ext_workload("abc def abc def\n"), prelude="Say: {source}")
    pre_ids = w.prelude_ids(specdec.assemble(model, tok, "none"))
    calls = []  # (kind, prelude?, documents in the on pipeline's store before the run)
    real = runner._run_pipeline

    def spy(kind, pipe, ids, n, temp, seed, grammar=None):
        stores = [d.store for d in pipe.drafters if getattr(d, "store", None) is not None]
        calls.append((kind, ids == pre_ids, [s.n_documents for s in stores]))
        return real(kind, pipe, ids, n, temp, seed, grammar)

    monkeypatch.setattr(runner, "_run_pipeline", spy)
    policy = specdec.load_policy("copy").with_options("ngram_copy", store=True)
    order = []
    (res,) = run_bench(
        model,
        tok,
        [w],
        policy=policy,
        runs=2,
        max_tokens=5,
        on_run=lambda kind, w, temp, i: order.append((kind, i)),
    )
    # preludes are not reported to on_run: it sees the runs as without a prelude
    assert order == [("off", -1), ("on", -1), ("off", 0), ("on", 0), ("on", 1), ("off", 1)]
    # every run (warm-up included) follows a prelude on the same pipeline; the on
    # pipeline's store holds only the prelude's output when its run starts
    off_run = [("off", True, []), ("off", False, [])]
    on_run = [("on", True, [0]), ("on", False, [1])]
    assert calls == (off_run + on_run) * 2 + on_run + off_run
    assert res.identical is True and len(res.on) == 2


def test_run_bench_with_baseline_and_temperatures(loaded):
    model, tok = loaded
    order = []
    res = run_bench(
        model,
        tok,
        get_workloads(["prose"]),
        runs=2,
        temps=(0.0, 1.0),
        max_tokens=6,
        baseline="mlx-lm",
        on_run=lambda kind, w, temp, i: order.append((kind, temp, i)),
    )
    kinds = ("off", "mlx-lm", "on")
    rotated = ("mlx-lm", "on", "off")  # the second run starts with the second contender
    assert order == (
        [(k, 0.0, -1) for k in kinds]  # warm-up once per workload
        + [(k, 0.0, 0) for k in kinds]
        + [(k, 0.0, 1) for k in rotated]
        + [(k, 1.0, 0) for k in kinds]
        + [(k, 1.0, 1) for k in rotated]
    )
    assert [r.temp for r in res] == [0.0, 1.0]
    for r in res:
        assert r.identical is True  # sampled runs too: position-keyed sampling, one seed
        assert len(r.baseline) == 2
        d = r.details()
        assert d["none_vs_baseline"] > 0 and d["baseline"] == "mlx-lm"
    assert res[0].baseline_identical is True  # greedy: mlx-lm emits the same tokens
    assert res[1].baseline_identical is None


def test_run_bench_counts_steps_and_draws_progress(loaded):
    model, tok = loaded
    buf = io.StringIO()
    n = total_steps(2, 1, 2, baseline=False)
    prog = Progress(n, buf)
    run_bench(
        model, tok, get_workloads(["prose", "code-edit"]), runs=2, max_tokens=3, progress=prog
    )
    prog.close()
    assert prog.done == n == 2 * 2 * (2 + 1)
    lines = buf.getvalue().splitlines()
    assert len(lines) == n + 1 and lines[-1].startswith(f"specdec bench [{'#' * 24}] {n}/{n}")
    assert "code-edit temp 0: on run 2/2" in buf.getvalue()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(runs=0), "runs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temps=(-1.0,)), "temperature"),
        (dict(temps=()), "temperature"),
        (dict(baseline="vllm"), "baseline"),
        (dict(policy="nope"), "nope"),
    ],
)
def test_run_bench_bad_arguments(loaded, kwargs, needle):
    model, tok = loaded
    with pytest.raises(specdec.SpecdecError, match=needle):
        run_bench(model, tok, get_workloads(["prose"]), **kwargs)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("ngram_copy.max_block=4,8", ("ngram_copy", "max_block", [4, 8])),
        (
            "gdn_transaction.strategy=capture, tape",
            ("gdn_transaction", "strategy", ["capture", "tape"]),
        ),
        ("copy_governor.ema=0.5,1", ("copy_governor", "ema", [0.5, 1])),
        ("x.flag=true,false", ("x", "flag", [True, False])),
    ],
)
def test_parse_sweep(spec, expected):
    assert parse_sweep(spec) == expected


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("ngram_copy=4,8", "COMPONENT.OPTION="),
        ("ngram_copy.max_block", "COMPONENT.OPTION="),
        ("a.b.c=1", "COMPONENT.OPTION="),
        ("ngram_copy.max_block=", "empty value"),
        ("ngram_copy.max_block=4,,8", "empty value"),
        ("ngram_copy.max_block=4,4", "given twice"),
    ],
)
def test_parse_sweep_rejects(spec, needle):
    with pytest.raises(specdec.RequestError, match=needle):
        parse_sweep(spec)


def test_sweep_policies_name_and_set_the_option():
    pols = sweep_policies("copy", "ngram_copy.max_block=4,8")
    assert [p.name for p in pols] == [
        "copy[ngram_copy.max_block=4]",
        "copy[ngram_copy.max_block=8]",
    ]
    assert [p.options_for("ngram_copy")["max_block"] for p in pols] == [4, 8]
    assert all(p.drafters == ("ngram_copy",) and p.governor == "copy_governor" for p in pols)


def test_run_bench_several_policies_share_the_off_runs(loaded):
    model, tok = loaded
    order = []
    # On this tiny model a forward is as cheap as the loop's host work, so drafting
    # would stop paying once the pipeline measured a drafted round's overhead; the ladder
    # sizes blocks from outcomes, not from this machine's verify cost curve (with cost
    # sizing a CI run under load drafted nothing)
    tiny = specdec.load_policy("ngram").with_options(
        "ngram_copy", round_overhead=False, sizing="ladder"
    )
    pols = sweep_policies(tiny, "ngram_copy.max_block=2,8")
    res = run_bench(
        model,
        tok,
        [_ext_workload("abc def abc def abc def abc def\n")],
        policies=pols,
        runs=2,
        max_tokens=8,
        on_run=lambda kind, w, temp, i: order.append((kind, i)),
    )
    kinds = ["off", "on:ngram[ngram_copy.max_block=2]", "on:ngram[ngram_copy.max_block=8]"]
    assert order == [(k, i) for i in (-1, 0) for k in kinds] + [
        (k, 1) for k in kinds[1:] + kinds[:1]
    ]
    assert [r.policy for r in res] == [p.name for p in pols]
    a, b = res
    assert a.off is b.off and len(a.off) == 2  # one set of off runs for both
    assert len(a.on) == len(b.on) == 2 and a.on is not b.on
    assert a.identical and b.identical
    for r in res:
        d = r.details()
        assert d["commit_fraction"] == round(r.commit_fraction, 5)
        assert d["on_loop_overhead_ms"] > 0 and d["off_loop_overhead_ms"] > 0
        assert d["rollbacks"] == ["kv_trim"]
        assert all(s.drafted > 0 for s in r.on)  # the copy prompt gets drafts
        assert r.commit_fraction > 0  # drafted rounds were committed and timed
    with pytest.raises(specdec.RequestError, match="different names"):
        run_bench(model, tok, get_workloads(["prose"]), policies=["copy", "copy"])
    with pytest.raises(specdec.RequestError, match="policies is empty"):
        run_bench(model, tok, get_workloads(["prose"]), policies=[])


def _draft_policy(model, name="dm", **opts):
    """The target as its own draft model (the fair pair when no smaller model exists)."""
    return specdec.Policy(name=name, drafters=("draft_model",)).with_options(
        "draft_model", model=model, **opts
    )


def test_run_bench_compares_draft_model_with_mlx_lm_speculative(loaded):
    model, tok = loaded
    order = []
    buf = io.StringIO()
    prog = Progress(total_steps(1, 2, 2, baseline=True), buf)
    res = run_bench(
        model,
        tok,
        get_workloads(["prose"]),
        policy=_draft_policy(model, num_draft_tokens=3),
        runs=2,
        temps=(0.0, 1.0),
        max_tokens=10,
        baseline="mlx-lm",
        progress=prog,
        on_run=lambda kind, w, temp, i: order.append((kind, temp, i)),
    )
    prog.close()
    kinds = ("off", "mlx-lm", "mlx-lm-spec", "on")
    odd = ("off", "mlx-lm", "on", "mlx-lm-spec")  # odd runs: mlx-lm-spec after the policy
    sampled = ("off", "mlx-lm", "on")  # mlx-lm's speculative runs are greedy only
    assert order == (
        [(k, 0.0, -1) for k in kinds]
        + [(k, 0.0, 0) for k in kinds]
        + [(k, 0.0, 1) for k in odd]
        + [(k, 1.0, 0) for k in sampled]
        + [(k, 1.0, 1) for k in ("mlx-lm", "on", "off")]  # sampled rounds rotate
    )
    assert prog.done == prog.total == len(order)  # the bench counts its extra runs
    greedy, hot = res
    assert len(greedy.spec_baseline) == 2 and hot.spec_baseline == []
    r = greedy.record()
    assert list(r) == list(RECORD_FIELDS)
    assert r["spec_baseline_tps"] > 0 and r["on_vs_spec_baseline"] > 0
    # the same model pair, prompt and draft length, greedy: the same tokens
    assert r["spec_baseline_identical"] is True and r["identical"] is True
    d = greedy.details()
    assert d["spec_baseline"] == "mlx-lm speculative_generate_step"
    assert d["spec_baseline_draft_tokens"] == 3
    assert d["spec_baseline_acceptance"] == 1.0  # a model drafting for itself
    assert len(d["runs"]["spec_baseline"]) == 2
    assert d["runs"]["spec_baseline"][0]["kind"] == "mlx-lm-spec"
    assert d["runs"]["spec_baseline"][0]["generation_tokens"] == 10
    h = hot.record()
    assert (h["spec_baseline_tps"], h["on_vs_spec_baseline"], h["spec_baseline_identical"]) == (
        None,
        None,
        None,
    )
    table = spec_baseline_table(res)
    assert "| on / mlx-lm spec | same tokens |" in table
    assert "| prose | 0 | dm | 3 |" in table and "| prose | 1 |" not in table


@pytest.mark.parametrize(
    "opts, max_block, expected",
    [({}, 16, 4), ({"num_draft_tokens": 3}, 16, 3), ({}, 2, 2), ({"num_draft_tokens": 5}, 3, 3)],
)
def test_spec_baseline_drafts_as_many_tokens_as_the_drafter(loaded, opts, max_block, expected):
    """The drafter's ``num_draft_tokens`` (default 4), capped by the policy's max_block."""
    model, tok = loaded
    pol = attrs.evolve(_draft_policy(model, **opts), max_block=max_block)
    (r,) = run_bench(
        model, tok, get_workloads(["prose"]), policy=pol, runs=1, max_tokens=4, baseline="mlx-lm"
    )
    assert r.spec_draft_tokens == expected
    assert r.record()["spec_baseline_identical"] is True


def test_spec_baseline_only_with_the_mlx_lm_baseline_and_a_draft_model(loaded):
    model, tok = loaded
    order = []
    for kwargs in (dict(policy=_draft_policy(model)), dict(policy="copy", baseline="mlx-lm")):
        (r,) = run_bench(
            model,
            tok,
            get_workloads(["prose"]),
            runs=1,
            max_tokens=3,
            warmup=False,
            on_run=lambda kind, w, temp, i: order.append(kind),
            **kwargs,
        )
        assert r.spec_baseline == [] and r.record()["on_vs_spec_baseline"] is None
    assert "mlx-lm-spec" not in order
    assert spec_baseline_table([r]) == ""


def test_spec_baseline_is_shared_by_policies_with_the_same_pair(loaded):
    model, tok = loaded
    order = []
    pols = [
        _draft_policy(model, "a", num_draft_tokens=2),
        _draft_policy(model, "b", num_draft_tokens=2),
        _draft_policy(model, "c", num_draft_tokens=3),
    ]
    res = run_bench(
        model,
        tok,
        get_workloads(["prose"]),
        policies=pols,
        runs=2,
        max_tokens=4,
        baseline="mlx-lm",
        warmup=False,
        on_run=lambda kind, w, temp, i: order.append(kind),
    )
    assert order == (
        ["off", "mlx-lm", "mlx-lm-spec:a", "on:a", "on:b", "mlx-lm-spec:c", "on:c"]
        + ["off", "mlx-lm", "on:a", "on:b", "mlx-lm-spec:a", "on:c", "mlx-lm-spec:c"]
    )
    a, b, c = res
    assert a.spec_baseline is b.spec_baseline and len(a.spec_baseline) == 2
    assert [r.spec_draft_tokens for r in res] == [2, 2, 3]


def _sample(kind: str, tps: float) -> RunSample:
    return RunSample(
        kind=kind,
        tokens=[1],
        text="",
        decode_tps=tps,
        step_tps=tps,
        peak_memory_gb=0.0,
        tokens_per_forward=1.0,
        acceptance_rate=0.0,
    )


def _result(policy: str, off: list, on: list[float]) -> WorkloadResult:
    return WorkloadResult(
        workload="w",
        temp=1.0,
        policy=policy,
        prompt_tokens=1,
        max_tokens=1,
        off=off,
        on=[_sample("on", x) for x in on],
    )


def test_ratio_is_the_median_of_the_rounds_ratios():
    # Round 2 ran while the machine was slow: both of its runs took twice as long.
    off = [_sample("off", x) for x in (10.0, 5.0, 10.0)]
    res = _result("a", off, [11.0, 5.5, 9.0])
    assert res.paired_ratios == pytest.approx([1.1, 1.1, 0.9])
    assert res.ratio == pytest.approx(1.1)
    # the ratio of the medians (9 / 10) mixes rounds and reports a slowdown
    assert res.ratio_of_medians == pytest.approx(0.9)
    d = res.details()
    assert d["ratio"] == pytest.approx(1.1) and d["ratio_of_medians"] == pytest.approx(0.9)
    assert d["paired_ratios"] == pytest.approx([1.1, 1.1, 0.9])
    # runs that do not pair up fall back to the ratio of the medians
    odd = _result("a", off, [11.0, 5.5])
    assert odd.paired_ratios == [] and odd.ratio == pytest.approx(8.25 / 10)
    # a one-token answer is too short to time; one of SHORT_ANSWER_TOKENS is not
    assert res.short_answer and d["short_answer"] is True
    off[0].tokens = [1] * SHORT_ANSWER_TOKENS
    assert not res.short_answer


def test_policy_pairs_compare_each_policy_with_the_first_round_by_round():
    off = [_sample("off", x) for x in (10.0, 5.0, 10.0)]
    a = _result("copy", off, [10.0, 5.0, 12.0])
    b = _result("ngram", off, [10.0, 4.0, 10.0])
    c = _result("other", off, [10.0])  # does not pair up: left out
    pairs = policy_pairs([a, b, c])
    assert len(pairs) == 1
    p = pairs[0]
    assert (p["workload"], p["temp"], p["first"], p["other"]) == ("w", 1.0, "copy", "ngram")
    assert p["runs"] == pytest.approx([1.0, 1.25, 1.2])
    assert p["first_vs_other"] == pytest.approx(1.2)
    assert policy_pairs([a]) == []


def test_progress_redraws_one_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    p = Progress(4, buf)
    p.start("a")
    p.advance()
    p.start("b")
    p.close()
    text = buf.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and "\r" in text
    assert Progress(3, io.StringIO(), enabled=False).stream.getvalue() == ""


# -- the command -----------------------------------------------------------------


def test_cli_json_records_have_exactly_the_fields(capsys, byte_model):
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), *FAST, "--json")
    assert rc == 0, err
    records = json.loads(out)  # stdout is only the JSON list
    assert [r["workload"] for r in records] == [
        "code-edit",
        "code-rewrite",
        "extraction",
        "prose",
        "follow-up",
    ]
    for r in records:
        assert list(r) == list(RECORD_FIELDS)
        assert r["identical"] is True
        assert r["temp"] == 0.0 and r["policy"] == "copy"
        for k in ("off_tps", "on_tps", "ratio", "tokens_per_forward", "off_peak_gb", "on_peak_gb"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        assert 0.0 <= r["acceptance_rate"] <= 1.0
    # the progress bar and the table (with faithfulness) go to stderr
    assert "specdec bench [" in err and "done" in err
    assert "| workload | temp | off tok/s |" in err and "faithful" in err


def test_cli_table_on_stdout_without_json(capsys, byte_model):
    rc, out, err = run_cli(
        capsys, "bench", "--model", str(byte_model), *FAST, "-w", "prose", "--no-progress"
    )
    assert rc == 0, err
    assert out.startswith("| workload | temp | off tok/s | on tok/s | ratio |")
    assert "| prose | 0 |" in out and "code-edit" not in out
    # six tokens decode in well under a second: the table says the ratio is no timing
    assert re.search(r"Too short to time: prose at temp 0 \(\d tokens\)", out)
    # cut at --max-tokens: raise it; greedy, so no seed advice
    assert "raise --max-tokens" in out and "another --seed" not in out
    assert "specdec bench [" not in err  # --no-progress


def test_cli_sampled_runs_are_identical(capsys, byte_model):
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        *FAST,
        "-w",
        "code-edit",
        "--temp",
        "0",
        "--temp",
        "1",
        "--json",
    )
    assert rc == 0, err
    records = json.loads(out)
    assert [(r["workload"], r["temp"]) for r in records] == [("code-edit", 0.0), ("code-edit", 1.0)]
    assert all(r["identical"] for r in records)


def test_cli_baseline_details_and_plot(capsys, byte_model, tmp_path):
    plot, details = tmp_path / "bench.png", tmp_path / "bench.json"
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        *FAST,
        "-w",
        "extraction",
        "--baseline",
        "mlx-lm",
        "--plot",
        str(plot),
        "--details",
        str(details),
    )
    assert rc == 0, err
    assert "| none / mlx-lm |" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads(details.read_text())
    assert d["verify_attention"]["replica"] is True, d["verify_attention"]
    assert "verify attention: a replica of MLX's softmax (bit-identical" in err
    (r,) = d["results"]
    assert r["baseline"] == "mlx-lm" and r["none_vs_baseline"] > 0
    assert 0.0 <= r["faithfulness"] <= 1.0
    assert len(r["runs"]["off"]) == len(r["runs"]["on"]) == len(r["runs"]["baseline"]) == 1
    assert "text" in r["runs"]["off"][0] and "tokens" in r["runs"]["on"][0]


def test_cli_draft_model_policy_against_mlx_lm_speculative(capsys, byte_model, tmp_path):
    toml = tmp_path / "draft.toml"
    toml.write_text(
        f'drafters = ["draft_model"]\n\n[options.draft_model]\nmodel = "{byte_model}"\n'
        "num_draft_tokens = 3\n"
    )
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        *FAST,
        "-w",
        "prose",
        "--policy",
        str(toml),
        "--baseline",
        "mlx-lm",
        "--json",
        "--no-progress",
    )
    assert rc == 0, err
    (r,) = json.loads(out)
    assert list(r) == list(RECORD_FIELDS)
    assert r["spec_baseline_tps"] > 0 and r["on_vs_spec_baseline"] > 0
    assert r["spec_baseline_identical"] is True
    assert "| on / mlx-lm spec | same tokens |" in err  # the table is printed too


def test_cli_plot_needs_matplotlib(capsys, no_model_loading, byte_model, tmp_path, monkeypatch):
    monkeypatch.setattr(bench_command, "matplotlib_available", lambda: False)
    rc, out, err = run_cli(
        capsys, "bench", "--model", str(byte_model), "--plot", str(tmp_path / "p.png")
    )
    assert_usage_error(rc, out, err, "pip install matplotlib")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--runs", "0"], "--runs must be >= 1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--temp", "nan"], "--temp must be >= 0"),
        (["--runs", "x"], "invalid int value"),
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--baseline", "vllm"], "invalid choice"),
        (["--plot", "/no/such/folder/p.png"], "does not exist"),
        (["--details", "/no/such/folder/d.json"], "does not exist"),
        (["--distributed"], "not one of several ranks: run it under mlx.launch"),
        (["--compare-single"], "--compare-single goes with --distributed"),
        (["--sharding", "pipeline"], "--sharding goes with --distributed"),
        (["--distributed", "--batch", "2"], "--distributed does not take --batch"),
    ],
)
def test_cli_bad_arguments(capsys, no_model_loading, byte_model, args, needle):
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), *args)
    assert_usage_error(rc, out, err, needle)


def test_cli_missing_model(capsys, no_model_loading, tmp_path):
    rc, out, err = run_cli(capsys, "bench", "--model", str(tmp_path / "nope"))
    assert_usage_error(rc, out, err, "no such folder")


def test_cli_policy_with_unknown_component(capsys, no_model_loading, byte_model, tmp_path):
    toml = tmp_path / "p.toml"
    toml.write_text('drafters = ["no_such_drafter"]\n')
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), "--policy", str(toml))
    assert_usage_error(rc, out, err, "no_such_drafter")


def test_cli_sweep_table_has_a_row_per_value(capsys, byte_model, tmp_path):
    details = tmp_path / "d.json"
    # The copy preset with ngram_copy's ladder sizing: on a random model whose drafts
    # are rejected, the cost sizing may find that no block pays (it depends on the
    # measured timings), and the rounds table would then have no row.
    policy = tmp_path / "copy.toml"
    policy.write_text(
        'name = "copy"\ndrafters = ["ngram_copy"]\ngovernor = "copy_governor"\n'
        '[options.ngram_copy]\nsizing = "ladder"\n'
    )
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        "--policy",
        str(policy),
        *FAST,
        "-w",
        "code-edit",
        "--baseline",
        "mlx-lm",
        "--sweep",
        "ngram_copy.max_block=2,4",
        "--no-progress",
        "--details",
        str(details),
    )
    assert rc == 0, err
    assert "| workload | temp | policy | off tok/s |" in out and "| commit/verify |" in out
    assert "| code-edit | 0 | copy[ngram_copy.max_block=2] |" in out
    assert "| code-edit | 0 | copy[ngram_copy.max_block=4] |" in out
    tables, rounds = out.split("| rounds without draft |")
    # two policies, one baseline row, and the second policy against the first
    assert tables.count("| code-edit | 0 |") == 4
    assert (
        "| code-edit | 0 | copy[ngram_copy.max_block=2] / copy[ngram_copy.max_block=4] |" in tables
    )
    assert rounds.count("| code-edit | 0 | copy[") == 2  # how each policy spent its rounds
    d = json.loads(details.read_text())
    assert d["policies"] == ["copy[ngram_copy.max_block=2]", "copy[ngram_copy.max_block=4]"]
    assert d["random_weights"] is False


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sweep", "nope.x=1,2"], "no installed component is named 'nope'"),
        (["--sweep", "ngram_copy.max_block"], "COMPONENT.OPTION="),
        (["--policy", "ngram", "--sweep", "copy_governor.ema=0.5,0.9"], "does not use"),
        (["--random-weights"], "has weights"),
    ],
)
def test_cli_sweep_and_random_weights_errors(capsys, no_model_loading, byte_model, args, needle):
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), *args)
    assert_usage_error(rc, out, err, needle)


def test_cli_random_weights_need_a_model(capsys, no_model_loading):
    rc, out, err = run_cli(capsys, "bench", "--random-weights")
    assert_usage_error(rc, out, err, "--random-weights needs --model FOLDER")


def test_cli_config_only_folder_without_random_weights(capsys, no_model_loading, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    rc, out, err = run_cli(capsys, "bench", "--model", str(tmp_path))
    assert_usage_error(rc, out, err, "no weights")


def test_cli_random_weights_from_a_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    rc, out, err = run_cli(
        capsys, "bench", "--model", str(tmp_path), "--random-weights", *FAST, "--json"
    )
    assert rc == 0, err
    assert "(random weights, seed 0)" in err
    records = json.loads(out)
    assert [r["workload"] for r in records] == [
        "code-edit",
        "code-rewrite",
        "extraction",
        "prose",
        "follow-up",
    ]
    assert all(r["identical"] for r in records)
    assert "| n/a |" in err  # no faithfulness for a model with random weights


def test_bench_is_listed_in_help(capsys):
    rc, out, err = run_cli(capsys, "--help")
    assert rc == 0 and "bench" in out


def test_cli_several_policies_side_by_side(capsys, byte_model, tmp_path):
    details = tmp_path / "d.json"
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        *FAST,
        "-w",
        "code-edit",
        "--policy",
        "copy",
        "--policy",
        "ngram",
        "--no-progress",
        "--details",
        str(details),
    )
    assert rc == 0, err
    tables = out.split("| rounds without draft |")[0]
    assert "| code-edit | 0 | copy |" in tables and "| code-edit | 0 | ngram |" in tables
    recs = json.loads(details.read_text())
    recs = recs["results"] if isinstance(recs, dict) else recs
    assert sorted(r["policy"] for r in recs) == ["copy", "ngram"]
    for r in recs:
        assert sum(r["on_block_sizes"].values()) >= r["on_forwards"] > 0
        assert r["on_rounds_without_draft"] <= r["on_forwards"]
        assert len(r["paired_ratios"]) == 1  # FAST: one run each
    # copy against ngram, round by round, in the table and the details
    assert "| code-edit | 0 | copy / ngram |" in out
    (pair,) = json.loads(details.read_text())["policy_pairs"]
    assert (pair["first"], pair["other"], len(pair["runs"])) == ("copy", "ngram", 1)
    assert pair["first_vs_other"] > 0


def test_cli_constrained_workload_reports_documents_and_forced_tokens(capsys, byte_model, tmp_path):
    """A workload with a schema runs constrained (no mlx-lm peer: it has none); the table
    says how many runs gave a complete document and what the grammar engine cost."""
    details = tmp_path / "d.json"
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        "--runs",
        "1",
        "--max-tokens",
        "60",
        "-w",
        "json-form",
        "--policy",
        "forced",
        "--baseline",
        "mlx-lm",
        "--no-progress",
        "--details",
        str(details),
    )
    assert rc == 0, err
    assert "constrained decoding (mlx-lm has none: no peer runs)" in out
    assert "| json-form | 0 | forced | " in out.split("constrained decoding")[1]
    (rec,) = json.loads(details.read_text())["results"]
    g = rec["grammar"]
    assert g["on_forced_per_answer"] > 0 and g["runs"] == [1, 1]
    assert rec["identical"] is True and rec["runs"]["baseline"] == []
    for kind in ("off", "on"):
        (run,) = rec["runs"][kind]
        assert run["forced"] is not None and run["grammar_complete"] is not None
    assert rec["runs"]["on"][0]["forced"] == g["on_forced_per_answer"]


def test_cli_same_policy_twice_is_an_error(capsys, byte_model):
    rc, _, err = run_cli(
        capsys, "bench", "--model", str(byte_model), "--policy", "copy", "--policy", "copy"
    )
    assert rc != 0 and "more than once" in err


# -- the exactness audit -----------------------------------------------------------


def test_first_divergence_names_the_position_and_the_plain_gap():
    from specdec.bench.runner import first_divergence
    from specdec.testing import make_tiny_model, plain_greedy

    model = make_tiny_model("llama")
    prompt = [3, 17, 42, 9, 28, 5]
    ref = plain_greedy(model, prompt, 8)
    assert first_divergence(model, prompt, ref, list(ref)) is None
    got = ref[:4] + [(ref[4] + 1) % 64] + ref[5:]
    d = first_divergence(model, prompt, ref, got)
    assert d["position"] == 4 and d["plain_token"] == ref[4] and d["got_token"] == got[4]
    import mlx.core as mx

    logits = model(mx.array(prompt + ref[:4])[None])[0, -1]
    top = sorted(logits.tolist())[-2:]
    assert (
        d["plain_top2_gap"] == pytest.approx(top[1] - top[0], abs=1e-5) and d["plain_top2_gap"] > 0
    )
    # an output that stopped early diverges where it ended
    short = first_divergence(model, prompt, ref, ref[:6])
    assert short["position"] == 6 and short["got_token"] is None


def test_cli_dtype_reports_every_greedy_run(capsys, byte_model, tmp_path):
    details = tmp_path / "d.json"
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        "--runs",
        "2",
        "--max-tokens",
        "6",
        "-w",
        "prose",
        "--dtype",
        "bfloat16",
        "--no-progress",
        "--details",
        str(details),
    )
    assert rc == 0, err
    assert "cast to bfloat16" in err
    assert "| workload | policy | runs matching plain | first divergence" in out
    row = next(line for line in out.splitlines() if line.startswith("| prose | copy |"))
    d = json.loads(details.read_text())
    assert d["dtype"] == "bfloat16"
    divs = d["results"][0]["divergences"]
    assert f"| {3 - len(divs)}/3 |" in row  # one more off run and two on runs
    for x in divs:
        assert x["position"] >= 0 and x["kind"] in ("off", "on")


def test_cli_dtype_choices(capsys, no_model_loading, byte_model):
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), "--dtype", "int8")
    assert rc == 2 and "--dtype" in err and "bfloat16" in err


# -- --batch --------------------------------------------------------------------------


def test_cli_batch_compares_the_policy_with_none_and_mlx_lm_batch_generate(capsys, byte_model):
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        "--batch",
        "1,3",
        "-w",
        "code-edit",
        "--runs",
        "1",
        "--max-tokens",
        "12",
        "--json",
    )
    assert rc == 0, err
    records = json.loads(out)
    assert [(r["workload"], r["batch"]) for r in records] == [("code-edit", 1), ("code-edit", 3)]
    for r in records:
        b = r["batch"]
        assert r["policy"] == "copy"
        for k in ("off_tps", "on_tps", "mlx_lm_tps", "on_vs_off", "on_vs_mlx_lm"):
            assert isinstance(r[k], float) and r[k] > 0, (k, r)
        # every row of every contender is the prompt decoded alone
        assert r["rows_identical"] == {"off": f"{b}/{b}", "on": f"{b}/{b}", "mlx-lm": f"{b}/{b}"}
        # the byte model's drafts are rejected; drafting in a batch is tested in test_batch.py
        assert r["tokens_per_forward"] >= 1.0 and 0.0 <= r["acceptance_rate"] <= 1.0
        # the widths the batch fed its rows: every round with all b rows, none narrower
        assert sum(r["widths"].values()) > 0 and all(int(w) >= 1 for w in r["widths"])
        assert r["mean_width"] >= 1.0 and r["cut_tokens"] >= 0
    assert "| code-edit | 3 |" in err and "mlx-lm batch_generate" in err
    assert "mean width (tokens cut)" in err


def test_cli_batch_measures_several_policies_against_the_same_runs(capsys, byte_model, tmp_path):
    rows = tmp_path / "copy-rows.toml"
    rows.write_text(
        'drafters = ["ngram_copy"]\ngovernor = "copy_governor"\nbatch_sizing = "rows"\n'
    )
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--model",
        str(byte_model),
        "--batch",
        "2",
        "-w",
        "code-edit",
        "--policy",
        "copy",
        "--policy",
        str(rows),
        "--runs",
        "1",
        "--max-tokens",
        "8",
        "--json",
    )
    assert rc == 0, err
    records = json.loads(out)
    assert [r["policy"] for r in records] == ["copy", "copy-rows"]
    # one none run and one mlx-lm run, shared by both records
    assert records[0]["runs"]["off"] == records[1]["runs"]["off"]
    assert records[0]["runs"]["mlx-lm"] == records[1]["runs"]["mlx-lm"]
    assert records[0]["runs"]["on"] != records[1]["runs"]["on"]
    assert all(r["rows_identical"]["on"] == "2/2" for r in records)
    assert records[1]["cut_tokens"] == 0  # batch_sizing = "rows" never cuts
    assert "| code-edit | 2 | copy-rows |" in err


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--batch", "0"], "--batch takes batch sizes >= 1"),
        (["--batch", "2,x"], "--batch takes batch sizes >= 1"),
        (["--batch", "2", "--baseline", "mlx-lm"], "does not take --baseline"),
        (["--batch", "2", "--temp", "1"], "does not take --temp"),
    ],
)
def test_cli_batch_bad_arguments(capsys, no_model_loading, byte_model, args, needle):
    rc, out, err = run_cli(capsys, "bench", "--model", str(byte_model), *args)
    assert_usage_error(rc, out, err, needle)
