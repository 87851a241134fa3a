"""ngram_copy in the core pipeline, on tiny random models from the test kit."""

from __future__ import annotations

import functools
import random

import pytest
import specdec
from specdec.testing import (
    FAULTS,
    check_caches_match_plain,
    check_drafter_faults,
    check_fewer_forwards,
    check_greedy_identity,
    check_listed,
    check_sampled_distribution,
    make_tiny_model,
    require_installed,
)

# On these tiny models a forward costs about as much as the loop's host work, so with
# the measured round overhead (round_overhead = true, the default) few blocks pay and
# which ones would depend on the machine's timing. The tests here price blocks by the
# verify curve alone; the "defaults" variant below runs the default.
_TINY = {"ngram_copy": {"round_overhead": False}}
COPY = specdec.Policy(
    name="copy", drafters=("ngram_copy",), governor="copy_governor", options=_TINY
)
NGRAM = specdec.Policy(name="ngram", drafters=("ngram_copy",), options=_TINY)
# gemma3's sliding window (8) wraps in every test here. A random gemma3 with a 64-token
# vocabulary neither copies its prompt nor loops within a short test, so the copy tests
# use a 16-token vocabulary for it.
MODELS = (("llama", 64), ("qwen3", 64), ("gemma3", 16))


def plain_tokens(model, prompt, n):
    return specdec.assemble(model, policy="none").generate(list(prompt), max_tokens=n).tokens


@functools.cache
def _copy_heavy(arch, vocab, min_accepted, policy):
    model = make_tiny_model(arch, vocab_size=vocab, seed=0)
    plain = specdec.assemble(model, policy="none")
    spec = specdec.assemble(model, policy=policy)
    tried = []
    for s in range(16):
        rng = random.Random(s)
        seed = [rng.randrange(vocab) for _ in range(10)]
        cont = plain.generate(seed, max_tokens=48).tokens
        # The model's own greedy continuation repeated in the prompt (prompt + continuation +
        # prompt); failing that, a prompt that ends inside the model's own repetition loop.
        for prompt in (seed + cont[:40] + seed, seed + cont):
            accepted = spec.generate(prompt, max_tokens=32).stats.accepted
            if accepted >= min_accepted:
                return tuple(prompt)
            tried.append(accepted)
    raise AssertionError(
        f"no copy-heavy prompt found for tiny {arch} (vocab {vocab}): accepted {tried}"
    )


def copy_heavy(arch, vocab, min_accepted=8, policy=NGRAM):
    """A prompt on which ``policy`` gets ``min_accepted`` drafts accepted in 32 greedy tokens.

    Tiny random models do not all copy their prompt; the search over a few seeds is
    deterministic, so every run of the tests uses the same prompt.
    """
    return list(_copy_heavy(arch, vocab, min_accepted, policy))


@pytest.fixture(scope="module", params=MODELS, ids=[f"{a}-v{v}" for a, v in MODELS])
def arch_model(request):
    arch, vocab = request.param
    return arch, vocab, make_tiny_model(arch, vocab_size=vocab, seed=0)


# -- installation ------------------------------------------------------------------------


def test_installed_through_entry_point():
    # require_installed skips when the tests run from a source tree, and fails under CI
    dist = require_installed("specdec-plugin-ngram")
    eps = [ep for ep in dist.entry_points if ep.group == "specdec"]
    assert [(ep.name, ep.value) for ep in eps] == [("ngram_copy", "specdec_ngram.plugin")]
    info = specdec.get_plugin_host().get("drafter", "ngram_copy")
    assert info.distribution == "specdec-plugin-ngram"
    assert info.description


def test_listed_by_specdec_plugins():
    check_listed("specdec-plugin-ngram", {"drafter": ["ngram_copy"]})


def test_policy_options_reach_the_drafter():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    pol = NGRAM.with_options("ngram_copy", min_n=3, max_block=5, source="prompt")
    pipe = specdec.assemble(model, policy=pol)
    (drafter,) = pipe.drafters
    assert (drafter.min_n, drafter.max_block, drafter.source) == (3, 5, "prompt")


def test_options_from_a_toml_policy(tmp_path):
    path = tmp_path / "copy.toml"
    path.write_text(
        'drafters = ["ngram_copy"]\ngovernor = "copy_governor"\n\n'
        "[options.ngram_copy]\n"
        'source = "prompt"\nmin_n = 3\nmax_n = 6\nladder = [[3, 2], [6, 12]]\n'
        "max_block = 12\nmax_edits = 0\nrealign = false\n\n"
        "[options.copy_governor]\nprobation_cap = 2\n",
        encoding="utf-8",
    )
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    pipe = specdec.assemble(model, policy=specdec.load_policy(path))
    (d,) = pipe.drafters
    assert (d.source, d.min_n, d.max_n, d.max_block) == ("prompt", 3, 6, 12)
    assert d.ladder == ((3, 2), (6, 12)) and (d.max_edits, d.realign) == (0, False)
    assert pipe.governor.probation_cap == 2


def test_unknown_option_fails_at_assemble():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    with pytest.raises(specdec.PolicyError, match="accepted options"):
        specdec.assemble(model, policy=NGRAM.with_options("ngram_copy", n_max=4))


# -- greedy: identical to plain decoding ------------------------------------------------------


@pytest.mark.parametrize("policy", [COPY, NGRAM], ids=["copy", "ngram"])
def test_greedy_identity_copy_heavy(arch_model, policy):
    arch, vocab, model = arch_model
    prompt = copy_heavy(arch, vocab)
    totals = check_greedy_identity(model, policy, prompt, max_tokens_list=range(1, 17))
    assert totals["drafted"] > 0 and totals["accepted"] > 0


def test_greedy_identity_with_explicit_stop_tokens(arch_model):
    arch, vocab, model = arch_model
    prompt = copy_heavy(arch, vocab)
    out = plain_tokens(model, prompt, 24)
    # Tokens whose first appearance is past the start, so the stop lands inside a block;
    # and a token that never appears (the stream runs to max_tokens).
    firsts = [t for i, t in enumerate(out) if i >= 1 and t not in out[:i]]
    absent = next(t for t in range(vocab) if t not in out)
    for stops in ([firsts[-1]] if firsts else [], firsts[:2], [absent]):
        if not stops:
            continue
        totals = check_greedy_identity(
            model, NGRAM, prompt, max_tokens_list=(24,), stop_tokens=tuple(stops)
        )
        assert totals["drafted"] > 0


def test_greedy_identity_small_blocks_and_prompt_source(arch_model):
    arch, vocab, model = arch_model
    pol = NGRAM.with_options("ngram_copy", source="prompt", ladder=[[1, 1], [3, 3]], min_n=1)
    prompt = copy_heavy(arch, vocab, min_accepted=4, policy=pol)
    check_greedy_identity(model, pol, prompt, max_tokens_list=(1, 2, 7, 16))


def test_greedy_identity_when_drafts_are_mostly_rejected():
    # gemma3 with a 64-token vocabulary does not copy: blocks are rejected and rolled
    # back in a sliding-window cache that wraps.
    model = make_tiny_model("gemma3", vocab_size=64, seed=0)
    prompt = copy_heavy("gemma3", 64, min_accepted=1)
    check_greedy_identity(model, NGRAM, prompt, max_tokens_list=range(1, 17))
    check_greedy_identity(model, COPY, prompt, max_tokens_list=(8, 32), require_drafts=False)


def test_greedy_identity_without_copy_material():
    # A prompt with no repetition: few or no proposals, and the stream must not change.
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    check_greedy_identity(
        model, COPY, list(range(1, 20)), max_tokens_list=(1, 8, 24), require_drafts=False
    )


def test_caches_match_plain(arch_model):
    arch, vocab, model = arch_model
    check_caches_match_plain(model, COPY, copy_heavy(arch, vocab), max_tokens=32)


# -- fewer forwards, with drafts that ran ------------------------------------------------------


def test_fewer_forwards_on_copy_heavy_prompt(arch_model):
    arch, vocab, model = arch_model
    prompt = copy_heavy(arch, vocab, min_accepted=12, policy=COPY)
    plain_f, spec_f = check_fewer_forwards(model, COPY, prompt, max_tokens=32)
    assert spec_f < plain_f
    out = specdec.assemble(model, policy=COPY).generate(prompt, max_tokens=32)
    s = out.stats
    assert s.drafted > 0 and s.accepted > 0
    assert s.target_forwards == spec_f
    assert s.tokens_per_forward > 1.5
    per = s.per_drafter["ngram_copy"]
    assert per["hits"] > 0 and per["accepted_tokens"] == s.accepted
    assert per["indexed_tokens"] >= len(prompt) + len(out.tokens) - 1
    assert per["resyncs"] == 0
    assert "ngram_copy" in s.governor["drafters"]


def test_copy_preset_drafts_as_ungoverned_ngram_from_the_first_round():
    # The copy preset puts no drafter on probation (probation_rounds = 0): ngram_copy
    # sizes its own blocks, so a governed request opens with the same blocks as the
    # ngram preset. The governor's own default (2 good rounds at a cap of 4 tokens)
    # caps the first blocks, which is what the preset turns off.
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = list(copy_heavy("llama", 64))
    copy = specdec.load_policy("copy").with_options("ngram_copy", **_TINY["ngram_copy"])
    ngram = specdec.load_policy("ngram").with_options("ngram_copy", **_TINY["ngram_copy"])
    assert copy.options_for("copy_governor")["probation_rounds"] == 0
    governed = specdec.assemble(model, policy=copy).generate(prompt, max_tokens=32)
    alone = specdec.assemble(model, policy=ngram).generate(prompt, max_tokens=32)
    assert governed.tokens == alone.tokens == plain_tokens(model, prompt, 32)
    g, a = governed.stats, alone.stats
    assert g.accepted > 0 and max(g.block_sizes) > 4
    assert (g.target_forwards, g.drafted, g.accepted) == (
        a.target_forwards,
        a.drafted,
        a.accepted,
    )
    assert g.block_sizes == a.block_sizes
    assert g.governor["drafters"]["ngram_copy"]["on_probation"] is False
    on_probation = copy.with_options("copy_governor", probation_rounds=2)
    capped = specdec.assemble(model, policy=on_probation).generate(prompt, max_tokens=32)
    assert capped.tokens == alone.tokens
    assert capped.stats.block_sizes != a.block_sizes
    assert capped.stats.target_forwards > a.target_forwards


def test_max_tokens_exact_with_long_blocks():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = copy_heavy("llama", 64)
    pipe = specdec.assemble(model, policy=NGRAM)
    plain = plain_tokens(model, prompt, 40)
    for mt in (1, 2, 3, 5, 17, 33, 40):
        out = pipe.generate(prompt, max_tokens=mt)
        assert out.tokens == plain[:mt]


def test_drafter_is_reset_between_requests():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    pipe = specdec.assemble(model, policy=COPY)
    prompt = copy_heavy("llama", 64)
    a = pipe.generate(prompt, max_tokens=24)
    b = pipe.generate(list(range(1, 20)), max_tokens=8)
    c = pipe.generate(prompt, max_tokens=24)
    assert a.tokens == c.tokens
    assert a.stats.drafted == c.stats.drafted and a.stats.accepted == c.stats.accepted
    assert b.stats.per_drafter["ngram_copy"]["indexed_tokens"] < len(prompt)


# -- sampled -----------------------------------------------------------------------------------


def test_sampled_distribution_is_the_targets():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = copy_heavy("llama", 64)
    check_sampled_distribution(model, NGRAM, prompt, temperature=1.0, max_tokens=2, n_samples=1500)


def test_sampled_seeded_runs_match_plain():
    # Position-keyed sampling: a seeded run with copy drafts emits the seeded plain run.
    from specdec.testing import check_sampled_identity as check

    model = make_tiny_model("llama", vocab_size=64, seed=0)
    totals = check(
        model, COPY, copy_heavy("llama", 64), seeds=range(4), max_tokens=24, temperature=1.0
    )
    assert totals["drafted"] > 0


# -- every sizing and continuation option stays exact ------------------------------------------

VARIANTS = [
    {"sizing": "cost", "continuation": "frequent"},
    {"sizing": "cost", "continuation": "recent"},
    {"sizing": "ladder", "continuation": "frequent"},
    {"sizing": "cost", "continuation": "frequent", "min_share": 0.6, "decay": 1.0},
    {"learn_bonus": True},
    {"learn": "continuation"},
    {"round_overhead": True},  # the defaults: whether a block pays depends on timing here
]
VARIANT_IDS = [
    "cost-frequent",
    "cost-recent",
    "ladder-frequent",
    "min-share",
    "learn-bonus",
    "learn-continuation",
    "defaults",
]
SAMPLED = [0, 1, 4, 5]  # the cost sizing's variants: which tokens it proposes, and when


@pytest.mark.parametrize("options", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("governed", [False, True], ids=["ngram", "copy"])
def test_greedy_identity_for_every_option(arch_model, options, governed):
    arch, vocab, model = arch_model
    base = COPY if governed else NGRAM
    pol = base.with_options("ngram_copy", **options)
    defaults = options.get("round_overhead", False)
    # Each variant's prompt is searched with the variant itself: the cost sizing reads the
    # verify curve profiled on this machine, so which blocks a variant drafts (and whether
    # a random model follows them) is the machine's; the search keeps the test exact and
    # its drafts accepted wherever it runs. The defaults' blocks also depend on timing.
    prompt = copy_heavy(arch, vocab) if defaults else copy_heavy(arch, vocab, 4, pol)
    totals = check_greedy_identity(
        model, pol, prompt, max_tokens_list=(1, 5, 16, 32), require_drafts=not defaults
    )
    assert totals["drafted"] > 0  # the first rounds draft before any overhead is measured
    if not defaults:
        assert totals["accepted"] > 0


@pytest.mark.parametrize(
    "options", [VARIANTS[i] for i in SAMPLED], ids=[VARIANT_IDS[i] for i in SAMPLED]
)
def test_sampled_distribution_for_the_cost_sizing(options):
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    pol = COPY.with_options("ngram_copy", **options)
    prompt = copy_heavy("llama", 64, policy=pol)
    check_sampled_distribution(model, pol, prompt, temperature=1.0, max_tokens=2, n_samples=1000)


def test_cost_sizing_reads_the_pipelines_curve_and_reports_its_choices():
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = copy_heavy("llama", 64)
    pipe = specdec.assemble(model, policy=NGRAM)
    assert pipe.cost_model is not None
    s = pipe.generate(prompt, max_tokens=32).stats
    per = s.per_drafter["ngram_copy"]
    assert per["sizing_used"] == "cost" and per["continuation"] == "frequent"
    assert sum(per["block_sizes"].values()) == per["hits"] > 0
    assert per["estimates"] and per["overall_estimate"]["outcomes"] > 0
    assert s.verify_cost["source"] in ("profiled", "disk", "memory", "refreshed")
    # The core's histogram counts the same blocks, plus the rounds that drafted nothing.
    drafted = {k: v for k, v in s.block_sizes.items() if k > 0}
    assert drafted == per["block_sizes"]
    ladder = specdec.assemble(model, policy=NGRAM.with_options("ngram_copy", sizing="ladder"))
    assert ladder.cost_model is None


@pytest.mark.parametrize("policy", [NGRAM, COPY], ids=["ngram", "copy"])
def test_faults_end_in_a_named_error_or_identical_output(policy):
    # the kit's fault check: ids outside the vocabulary (lazy ones too), an over-long
    # block, bad q, exceptions on the first and n-th call: a named error or plain output
    model = make_tiny_model("llama", vocab_size=64, seed=0)
    prompt = list(_copy_heavy("llama", 64, 6, policy))
    # long enough for a third propose call after two long accepted copies
    outcomes = check_drafter_faults(model, policy, prompt, max_tokens=48)
    assert {o.fault for o in outcomes} == set(FAULTS)
    assert all(repr("ngram_copy") in o.message for o in outcomes if o.outcome == "error")
