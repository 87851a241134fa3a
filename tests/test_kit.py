"""The test kit itself and the built-in verifiers."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import specdec
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import (
    ALL_ARCHITECTURES,
    ARCHITECTURES,
    EXTRA_ARCHITECTURES,
    OracleDrafter,
    check_caches_match_plain,
    check_fewer_forwards,
    check_greedy_identity,
    check_sampled_distribution,
    check_sampled_identity,
    copy_heavy_prompt,
    find_copy_prompt,
    plain_greedy,
)
from specdec.verifiers import HiddenStateVerifier, LogitsVerifier


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hidden_verifier_returns_the_same_logits_plus_hidden_states(models, arch):
    m = models[arch]
    toks = mx.array([3, 4, 5, 6])
    a = LogitsVerifier().verify(m, toks, make_prompt_cache(m))
    b = HiddenStateVerifier().verify(m, toks, make_prompt_cache(m))
    assert np.allclose(np.array(a.logits), np.array(b.logits), atol=1e-5)
    assert b.hidden.shape == (4, m.args.hidden_size)
    assert a.hidden is None


def test_hidden_verifier_pipeline_is_identical(models, copy_prompts):
    m = models["llama"]
    pol = specdec.Policy(drafters=("oracle",), verifier="hidden", options={"oracle": {"model": m}})
    out = specdec.assemble(m, policy=pol).generate(copy_prompts["llama"], max_tokens=12)
    assert out.tokens == plain_greedy(m, copy_prompts["llama"], 12)
    assert out.stats.verifier == "hidden"


@pytest.mark.parametrize("arch", ["llama", "gemma4"])
def test_row_projection_until_the_first_rejection_is_exact(models, copy_prompts, arch):
    """The hidden verifier's project="rows": greedy rounds project one position at a time
    and stop at the first rejection; the output is plain decoding's, and positions after
    a rejection are never projected (a partly wrong oracle rejects inside its blocks)."""
    m = models[arch] if arch in models else specdec.testing.make_tiny_model(arch)
    prompt = copy_prompts.get(arch) or copy_heavy_prompt(m, [3, 17, 42, 9, 28, 5, 61, 11], 8)
    pol = specdec.Policy(
        drafters=("oracle",),
        verifier="hidden",
        options={
            "oracle": {"model": m, "corruption": "partial", "block": 4},
            "hidden": {"project": "rows"},
        },
    )
    check_greedy_identity(m, pol, prompt, max_tokens_list=(1, 5, 16, 30))
    out = specdec.assemble(m, policy=pol).generate(prompt, max_tokens=30)
    rp = out.stats.row_projection
    assert rp["rounds"] == out.stats.rounds_with_draft > 0
    assert rp["skipped"] > 0 and rp["rows"] + rp["skipped"] == out.stats.drafted + rp["rounds"]
    # sampling, or the default: every position from the forward, nothing counted
    out = specdec.assemble(m, policy=pol).generate(prompt, max_tokens=12, temperature=0.8)
    assert out.stats.row_projection == {}
    with pytest.raises(specdec.PolicyError, match="project must be 'all' or 'rows'"):
        HiddenStateVerifier(project="some")


def test_tiny_models_are_cached_and_distinct(specdec_tiny_model):
    a = specdec_tiny_model("llama")
    assert a is specdec_tiny_model("llama")
    assert a is not specdec_tiny_model("llama", seed=2)
    assert ALL_ARCHITECTURES == ARCHITECTURES + EXTRA_ARCHITECTURES
    assert ARCHITECTURES == ("llama", "qwen3", "gemma3") and "gemma4" in EXTRA_ARCHITECTURES
    for arch in ALL_ARCHITECTURES:
        m = specdec_tiny_model(arch)
        out = plain_greedy(m, [3, 17, 42, 9, 28, 5, 61, 11], 16)
        assert len(set(out)) > 2, f"{arch} tiny model output is degenerate: {out}"
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        specdec_tiny_model("mamba")


def test_gemma3_tiny_model_has_wrapping_sliding_window(models):
    caches = make_prompt_cache(models["gemma3"])
    kinds = [type(c).__name__ for c in caches]
    assert "RotatingKVCache" in kinds and "KVCache" in kinds
    assert min(c.max_size for c in caches if type(c).__name__ == "RotatingKVCache") == 8


def test_oracle_corruption_modes(models):
    m = models["llama"]
    h = copy_heavy_prompt(m, [3, 17, 42, 9, 28, 5, 61, 11], 8)
    truth = plain_greedy(m, h, 6)

    def propose(history, n, **options):
        return OracleDrafter(**options).session(None).propose(history, n)

    assert propose(h, 6, model=m, block=6).tokens == tuple(truth)
    full = propose(h, 6, model=m, corruption="full", block=6).tokens
    assert all(a != b for a, b in zip(full, truth))
    part = propose(h, 6, model=m, corruption="partial", block=6).tokens
    assert sum(a != b for a, b in zip(part, truth)) == 1
    ref = OracleDrafter(reference=h + truth, vocab_size=64).session(None)
    assert ref.propose(h, 3).tokens == tuple(truth[:3])
    assert ref.propose([1, 2], 3) is None
    assert ref.stats() == {"proposals": 1}
    with pytest.raises(ValueError, match="corruption must be one of"):
        OracleDrafter(model=m, corruption="some")


def test_fresh_host_fixture(specdec_fresh_host):
    assert specdec.get_plugin_host() is specdec_fresh_host
    assert "draft_model" in specdec_fresh_host.names("drafter")


def test_greedy_identity_check_with_stop_as_first_token(models, copy_prompts):
    m = models["llama"]
    first = plain_greedy(m, copy_prompts["llama"], 1)[0]
    pol = specdec.Policy(drafters=("oracle",), options={"oracle": {"model": m}})
    r = check_greedy_identity(
        m,
        pol,
        copy_prompts["llama"],
        max_tokens_list=[4],
        stop_tokens=[first],
        require_drafts=False,
    )
    assert r["runs"] == 2


def test_cache_view_compares_arrays_cache_entries():
    """``ArraysCache.state`` is ``(list of arrays, left_padding, lengths)``: every array is compared."""
    from mlx_lm.models.cache import ArraysCache
    from specdec.testing import cache_view
    from specdec.testing.checks import _compare_views

    a, b = ArraysCache(2), ArraysCache(2)
    a[0], a[1] = mx.zeros((1, 3, 4)), mx.ones((1, 2, 2, 2))
    b[0], b[1] = mx.zeros((1, 3, 4)), mx.ones((1, 2, 2, 2))
    assert _compare_views(cache_view(a), cache_view(b), 1e-6, "same") == 0.0
    b[1] = b[1] + 1e-3
    with pytest.raises(AssertionError, match="max abs difference"):
        _compare_views(cache_view(a), cache_view(b), 1e-6, "different")


# -- the checks fail where speculation did not run or nothing was compared ---------------


#: The oracle following a reference the history never matches: it never proposes.
NEVER_PROPOSES = specdec.Policy(
    name="never", drafters=("oracle",), options={"oracle": {"reference": [0, 0, 0]}}
)


def test_sampled_identity_requires_drafts_by_default(models, copy_prompts):
    m, prompt = models["llama"], copy_prompts["llama"]
    with pytest.raises(AssertionError, match="no tokens were drafted"):
        check_sampled_identity(m, NEVER_PROPOSES, prompt, seeds=range(2), max_tokens=6)
    r = check_sampled_identity(
        m, NEVER_PROPOSES, prompt, seeds=range(2), max_tokens=6, require_drafts=False
    )
    assert r["drafted"] == 0 and r["runs"] == 2


def test_sampled_identity_requires_accepted_drafts(models, copy_prompts):
    m, prompt = models["llama"], copy_prompts["llama"]
    pol = specdec.Policy(
        drafters=("oracle",), options={"oracle": {"model": m, "corruption": "full"}}
    )
    with pytest.raises(AssertionError, match="none accepted"):
        check_sampled_identity(m, pol, prompt, seeds=range(1), max_tokens=6, temperature=0.0)


def test_cache_and_forward_checks_require_drafts_by_default(models, copy_prompts):
    m, prompt = models["llama"], copy_prompts["llama"]
    with pytest.raises(AssertionError, match="no tokens were drafted"):
        check_caches_match_plain(m, NEVER_PROPOSES, prompt, max_tokens=6)
    assert (
        check_caches_match_plain(m, NEVER_PROPOSES, prompt, max_tokens=6, require_drafts=False)
        <= 1e-4
    )
    with pytest.raises(AssertionError, match="no tokens were drafted"):
        check_fewer_forwards(m, NEVER_PROPOSES, prompt, max_tokens=6)
    with pytest.raises(AssertionError, match="no tokens were drafted"):
        check_sampled_distribution(m, NEVER_PROPOSES, prompt, max_tokens=1, n_samples=5)


def test_cache_check_fails_when_no_round_was_compared(models, copy_prompts):
    """A stop token inside the first accepted block ends both runs before any round both
    recorded (plain after 1 token, speculation after 5): that used to pass, comparing nothing."""
    m, prompt = models["llama"], copy_prompts["llama"]
    first = plain_greedy(m, prompt, 1)[0]
    pol = specdec.Policy(drafters=("oracle",), options={"oracle": {"model": m, "block": 4}})
    for require in (True, False):
        with pytest.raises(AssertionError, match="no round was compared"):
            check_caches_match_plain(
                m, pol, prompt, max_tokens=8, stop_tokens=[first], require_drafts=require
            )
    # without the stop token the same policy is compared after every round
    assert check_caches_match_plain(m, pol, prompt, max_tokens=8) <= 1e-4


def test_plain_reference_is_the_none_pipeline(models, copy_prompts):
    """``plain_greedy`` and the exact distribution come from ``assemble(model, "none")``."""
    from specdec.sampling import Sampler
    from specdec.testing.checks import _exact_joint

    m, prompt = models["llama"], copy_prompts["llama"]
    pipe = specdec.assemble(m, policy="none")
    assert plain_greedy(m, prompt, 8) == pipe.generate(prompt, max_tokens=8).tokens
    joint = _exact_joint(m, prompt, Sampler(temperature=1.0, seed=0), 1, floor=0.0)
    assert abs(sum(joint.values()) - 1.0) < 1e-4
    assert max(joint, key=joint.get) == tuple(plain_greedy(m, prompt, 1))


# -- entry-point tests skip in a source tree and fail under CI ---------------------------


def test_require_installed_skips_locally_and_fails_under_ci(monkeypatch):
    from specdec.testing import in_ci, require_command, require_installed

    missing = "specdec-plugin-that-is-not-installed"
    monkeypatch.delenv("CI", raising=False)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception, match=f"{missing} is not installed"):
        require_installed(missing)
    with pytest.raises(pytest.skip.Exception, match="command is not installed"):
        require_command("specdec-no-such-command")
    monkeypatch.setenv("CI", "true")
    assert in_ci()
    with pytest.raises(pytest.fail.Exception, match=f"{missing} is not installed.*CI is set"):
        require_installed(missing)
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        require_command("specdec-no-such-command")
    # installed: the distribution itself, whatever CI says
    assert require_installed("specdec-core").metadata["Name"] == "specdec-core"


def test_request_context_and_feed_round_drive_a_session_by_hand():
    from specdec.testing import feed_round, request_context

    ctx = request_context([1, 2, 3], max_tokens=9, options={"x": 1})
    assert ctx.prompt_tokens == [1, 2, 3] and ctx.max_tokens == 9 and ctx.options == {"x": 1}
    assert ctx.model is None and ctx.caches == []
    seen = []

    class S(specdec.BaseDrafterSession):
        def observe(self, result):
            seen.append(result)

    history = feed_round(S(), [1, 2, 3], [7, 8], block=[7, 5], n_accepted=1, drafter="d")
    assert history == [1, 2, 3, 7, 8]
    (r,) = seen
    assert (r.start_position, r.committed, r.token, r.block, r.n_accepted, r.drafter) == (
        3,
        (7, 8),
        8,
        (7, 5),
        1,
        "d",
    )
    with pytest.raises(ValueError, match="at least one token"):
        feed_round(S(), [1], [])


def test_find_copy_prompt_searches_for_accepted_copies(models):
    m = models["llama"]
    pol = specdec.load_policy("copy").with_options("ngram_copy", round_overhead=False)
    prompt = find_copy_prompt(m, pol, min_accepted=2, drafter="ngram_copy", seed_len=6, cont_len=20)
    assert len(prompt) == 32 and prompt[:6] == prompt[-6:]
    assert prompt[6:26] == plain_greedy(m, prompt[:6], 20)  # seed, continuation, seed
    st = specdec.assemble(m, policy=pol).generate(prompt, max_tokens=32).stats
    own = st.per_drafter["ngram_copy"]
    assert 2 <= own["accepted"] < own["drafted"]
    # none qualifies: every candidate's (drafted, accepted) is named
    with pytest.raises(AssertionError, match=r"no prompt of 3 gets at least 99 of ngram_copy's"):
        find_copy_prompt(m, pol, min_accepted=99, tries=3, drafter="ngram_copy")
    with pytest.raises(ValueError, match=r"drafter 'ngram' is not in policy 'copy'"):
        find_copy_prompt(m, pol, drafter="ngram")
    with pytest.raises(AssertionError, match=r"\(drafted, accepted\) \[\(0, 0\), \(0, 0\)\]"):
        find_copy_prompt(m, "none", min_accepted=1, tries=2)


class _TextCopy(specdec.BaseDrafter):
    """Copies what followed the last two tokens' previous occurrence; needs a tokenizer."""

    name = "text_copy"

    def session(self, ctx):
        if ctx.tokenizer is None:
            raise specdec.RequestError("text_copy needs a tokenizer (ctx.tokenizer is None)")
        return _TextCopySession(ctx.tokenizer)


class _TextCopySession(specdec.BaseDrafterSession):
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def propose(self, history, max_len):
        self.tokenizer.decode(history)  # it reads the text (here only to show it can)
        tail = list(history[-2:])
        for i in range(len(history) - 3, 0, -1):
            if list(history[i - 1 : i + 1]) == tail:
                block = list(history[i + 1 : i + 1 + max_len])
                return specdec.Draft(tokens=block) if block else None
        return None


class _TextCopyPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("text_copy", _TextCopy, description="copies; reads ctx.tokenizer")


def test_find_copy_prompt_passes_the_tokenizer_and_the_host(models):
    from specdec.plugins import PluginHost
    from specdec.testing import ToyTokenizer, plugin_host

    m, tok = models["llama"], ToyTokenizer()
    pol = specdec.Policy(drafters=("text_copy",))
    kw = dict(min_accepted=2, seed_len=6, cont_len=20, tries=8)
    with plugin_host(_TextCopyPlugin(), load_entry_points=False):
        # without a tokenizer every candidate's session fails
        with pytest.raises(specdec.RequestError, match="text_copy needs a tokenizer"):
            find_copy_prompt(m, pol, **kw)
        prompt = find_copy_prompt(m, pol, tokenizer=tok, **kw)
    assert prompt[:6] == prompt[-6:]
    # a host built by hand, not installed process-wide: passed as host=
    host = PluginHost(load_entry_points=False)
    host.register_plugin(_TextCopyPlugin(), name="text_copy_plugin", distribution="test")
    with pytest.raises(specdec.UnknownComponentError, match="text_copy"):
        find_copy_prompt(m, pol, tokenizer=tok, **kw)
    assert find_copy_prompt(m, pol, tokenizer=tok, host=host, **kw) == prompt
    st = specdec.assemble(m, tok, pol, host=host).generate(prompt, max_tokens=32).stats
    assert 2 <= st.accepted < st.drafted


def test_toy_tokenizer_alphabet_and_id_of():
    from specdec.testing import ToyTokenizer
    from specdec.testing.toy_tokenizer import ALPHABET, NEWLINE, SPACE

    tok = ToyTokenizer()
    assert (NEWLINE, SPACE) == (33, 26) == (tok.id_of("\n"), tok.id_of(" "))
    assert [tok.id_of(c) for c in "az.?09AT"] == [0, 25, 27, 32, 34, 43, 44, 63]
    assert len(ALPHABET) == 72 and ToyTokenizer(72).id_of(")") == 71
    assert tok.encode("ab\nc") == [0, 1, NEWLINE, 2] and tok.decode([0, 1, NEWLINE, 2]) == "ab\nc"
    assert tok.decode([72, 73]) == "ab"  # modulo the alphabet
    # U is id 64: outside the default vocabulary of 64
    with pytest.raises(ValueError, match=r"vocab_size=64\) cannot encode 'U'.*'abc"):
        tok.id_of("U")
    with pytest.raises(ValueError, match=r"cannot encode 'é'"):
        tok.encode("é")
    with pytest.raises(ValueError, match=r"cannot encode 'ab'"):
        tok.id_of("ab")
