"""The core 0.2 contract: sessions, verifier capabilities, prefill through the verifier,
logits through the model's own path, the K/V view, draft heads, the public rollback API."""

from __future__ import annotations

import ast
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import specdec
from core_support import SoloOnlyPlugin, oracle_policy
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import make_prompt_cache
from specdec.testing import ALL_ARCHITECTURES, cache_view, make_tiny_model, plugin_host

ROOT = Path(__file__).resolve().parents[1]


# -- per-request sessions --------------------------------------------------------


def _comparable(stats: specdec.Stats) -> dict:
    """A request's stats without wall times (which differ between runs)."""

    def strip(d):
        return {
            k: strip(v) if isinstance(v, dict) else v
            for k, v in d.items()
            if not (isinstance(k, str) and k.endswith(("_time_s", "_tps", "_s")))
            and k not in ("peak_memory_gb", "rollback_fraction", "shadow_fraction")
            # the pipeline's round overhead, learnt from wall times across requests
            and k != "round_overhead"
        }

    return strip(stats.to_dict())


def _run_interleaved(pipe, a, b, **kw):
    """Two streams on one pipeline, advanced one response at a time in turn."""
    sa, sb = pipe.stream(a, **kw), pipe.stream(b, **kw)
    out = {"a": [], "b": []}
    live = {"a": sa, "b": sb}
    while live:
        for key in list(live):
            try:
                out[key].append(next(live[key]))
            except StopIteration:
                del live[key]
    return out


@pytest.mark.parametrize("policy", ["copy", "draft"])
def test_interleaved_requests_equal_each_request_alone(models, copy_prompts, policy):
    model = models["llama"]
    if policy == "draft":
        pol = specdec.Policy(
            name="draft",
            drafters=("draft_model",),
            options={"draft_model": {"model": model, "num_draft_tokens": 3}},
        )
    else:
        # The block sizes here must not depend on the machine's timing: the round
        # overhead the pipeline measures (pipeline-wide, from wall times) is left out.
        pol = specdec.load_policy(policy).with_options("ngram_copy", round_overhead=False)
    pipe = specdec.assemble(model, policy=pol)
    a = copy_prompts["llama"]
    b = list(reversed(copy_prompts["llama"]))[:20]
    kw = dict(max_tokens=40, temperature=0.0)
    alone_a, alone_b = pipe.generate(a, **kw), pipe.generate(b, **kw)
    mixed = _run_interleaved(pipe, a, b, **kw)
    for alone, got in ((alone_a, mixed["a"]), (alone_b, mixed["b"])):
        assert [r.token for r in got if not r.is_stop_token] == alone.tokens
        assert _comparable(got[-1].stats) == _comparable(alone.stats)
    assert alone_a.stats.drafted > 0 and alone_a.stats.accepted > 0
    if policy == "copy":  # the governor's state is per request too
        assert mixed["a"][-1].stats.governor == alone_a.stats.governor


def test_a_drafter_without_sessions_is_a_clear_error(models):
    class OldStyle:
        name = "old_style"

        def begin(self, ctx):  # the 0.1 contract
            pass

        def propose(self, history, max_len):
            return None

    class Plugin:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("old_style", OldStyle)

    with plugin_host(Plugin(), load_entry_points=False) as host:
        with pytest.raises(specdec.PolicyError, match=r"old_style.*session\(ctx\)"):
            specdec.assemble(models["llama"], policy={"drafters": ["old_style"]}, host=host)


# -- verifier capabilities -------------------------------------------------------


class _NeedsHidden(specdec.BaseDrafter):
    """Records prefill chunks and proposes the target's argmax of the last hidden state."""

    name = "needs_hidden"
    needs = frozenset({"hidden"})
    chunks: list = []

    def __init__(self, head: str | None = "exact"):
        self.head = head

    def session(self, ctx):
        return _NeedsHiddenSession(ctx, self.chunks)


class _NeedsHiddenSession(specdec.BaseDrafterSession):
    def __init__(self, ctx, chunks):
        self.ctx, self.chunks, self.last_hidden = ctx, chunks, None
        assert ctx.caches[0].offset == 0  # made before prefill
        chunks.clear()

    def prefill(self, chunk):
        self.chunks.append(chunk)
        self.last_hidden = chunk.result.hidden[-1:]

    def propose(self, history, max_len):
        if self.last_hidden is None or self.ctx.head is None:
            return None
        # The hidden state at the position before the last token predicts the last
        # token: a proposal that the target accepts exactly when it is self-consistent.
        tok = int(mx.argmax(self.ctx.head.logits(self.last_hidden), axis=-1).item())
        return specdec.Draft(tokens=[tok])

    def observe(self, result):
        if result.verify is not None and result.verify.hidden is not None:
            self.last_hidden = result.verify.hidden[result.n_accepted : result.n_accepted + 1]


class _NeedsHiddenPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("needs_hidden", _NeedsHidden)


def test_missing_capability_fails_before_model_work_naming_everything():
    with plugin_host(_NeedsHiddenPlugin()) as host:
        with pytest.raises(specdec.PolicyError) as e:
            specdec.assemble(
                "/no/such/model", policy={"drafters": ["needs_hidden"]}, host=host
            )  # the model path is never looked at
    msg = str(e.value)
    for part in ("needs_hidden", "'hidden'", "'logits'", "installed verifiers", "hidden"):
        assert part in msg, msg


def test_unknown_capability_is_named():
    class Weird(specdec.BaseDrafter):
        name = "weird"
        needs = frozenset({"telepathy"})

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("weird", Weird)

    with plugin_host(P()) as host:
        with pytest.raises(specdec.PolicyError, match="telepathy.*capabilities are"):
            specdec.assemble(make_tiny_model("llama"), policy={"drafters": ["weird"]}, host=host)


# -- prefill through the verifier -------------------------------------------------


def test_prefill_goes_through_the_verifier_in_chunks_with_hidden_states(models, copy_prompts):
    model = models["llama"]
    prompt = copy_prompts["llama"]
    with plugin_host(_NeedsHiddenPlugin()) as host:
        pipe = specdec.assemble(
            model, policy={"drafters": ["needs_hidden"], "verifier": "hidden"}, host=host
        )
        rounds = []
        out = pipe.generate(
            prompt,
            max_tokens=12,
            prefill_step_size=5,
            on_round=lambda r, caches: rounds.append(r),
        )
    chunks = _NeedsHidden.chunks
    assert [c.start_position for c in chunks] == list(range(0, len(prompt) - 1, 5))
    assert [t for c in chunks for t in c.tokens] == prompt[:-1]
    # every prompt position but the last has its final hidden state, equal to a full forward's
    hidden = mx.concatenate([c.result.hidden for c in chunks], axis=0)
    assert hidden.shape == (len(prompt) - 1, model.args.hidden_size)
    taps = specdec.capture.model_taps(model)
    with taps.recording() as rec:
        model(mx.array(prompt[:-1])[None], cache=make_prompt_cache(model))
    assert np.allclose(np.array(hidden), np.array(rec["hidden"][0]), atol=1e-5)
    # the first round drafted from the prompt's hidden states
    assert rounds[0].drafter == "needs_hidden" and len(rounds[0].block) == 1
    assert out.stats.drafted > 0
    plain = specdec.assemble(model, policy="none").generate(prompt, max_tokens=12)
    assert out.tokens == plain.tokens


def test_prefill_step_size_must_be_positive(models):
    pipe = specdec.assemble(models["llama"], policy="none")
    with pytest.raises(specdec.RequestError, match="prefill_step_size"):
        pipe.generate([1, 2, 3], prefill_step_size=0)


# -- logits through the model's own path -----------------------------------------


@pytest.mark.parametrize("arch", ALL_ARCHITECTURES)
def test_hidden_verifier_logits_are_the_models_own(arch):
    model = make_tiny_model(arch)
    tokens = mx.array([3, 17, 42, 9, 28, 5, 61, 11, 3, 17, 42, 9])
    ref_cache, cache = make_prompt_cache(model), make_prompt_cache(model)
    verifier = specdec.verifiers.HiddenStateVerifier(layers=(0, -1))
    verifier.bind(model)
    for chunk in (tokens[:7], tokens[7:8], tokens[8:]):  # prefill, a step, a block
        ref = model(chunk[None], cache=ref_cache)[0].astype(mx.float32)
        got = verifier.verify(model, chunk, cache)
        diff = mx.abs(ref - got.logits).max().item()
        assert diff == 0.0, f"{arch}: logits differ from the model's by {diff}"
        assert got.hidden.shape == (chunk.shape[0], model.args.hidden_size)
        assert set(got.layers) == {0, -1}
        # the exact draft head applied to the hidden states is the model's output path
        head = specdec.heads.ExactHead()
        head.bind(model)
        assert mx.abs(head.logits(got.hidden) - ref).max().item() == 0.0
    if arch == "gemma4":  # final logit softcapping is applied (by the model, not by us)
        cap = model.args.final_logit_softcapping
        assert cap and mx.abs(ref).max().item() < cap


def test_taps_leave_the_parameter_tree_and_plain_calls_alone(models):
    model = make_tiny_model("llama")
    before = sorted(k for k, _ in _flat(model.parameters()))
    specdec.capture.model_taps(model)._layer_tap(0)
    assert sorted(k for k, _ in _flat(model.parameters())) == before
    x = mx.array([[1, 2, 3]])
    assert mx.array_equal(model(x), make_tiny_model("llama")(x))


def _flat(tree):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def test_hidden_verifier_rejects_bad_layers(models):
    with pytest.raises(specdec.PolicyError, match="out of range"):
        specdec.assemble(
            models["llama"],
            policy={"verifier": "hidden", "options": {"hidden": {"layers": [7]}}},
        )


# -- the K/V view ----------------------------------------------------------------


def _fed(model, tokens):
    caches = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=caches)
    return caches


def test_kv_view_of_plain_cache_is_every_entry_in_order():
    model = make_tiny_model("llama")
    caches = _fed(model, list(range(1, 12)))
    views = specdec.kvview.kv_views(caches)
    for c, v in zip(caches, views):
        assert v.length == 11 and v.offset == 11 and v.positions == tuple(range(11))
        assert v.window is None
        assert np.array_equal(np.array(v.keys), np.array(c.keys[..., :11, :]))
        assert np.array_equal(np.array(v.values), np.array(c.values[..., :11, :]))


def test_kv_view_of_quantized_cache_is_dequantized():
    model = make_tiny_model("gemma3")  # head_dim 32: a quantization group; layer 2 is global
    caches = _fed(model, list(range(1, 12)))
    plain = caches[2]
    assert type(plain) is mlx_cache.KVCache
    v = specdec.kvview.kv_view(plain.to_quantized(group_size=32, bits=8))
    assert v.length == 11 and v.keys.shape == plain.keys[..., :11, :].shape
    assert np.allclose(np.array(v.keys), np.array(plain.keys[..., :11, :]), atol=0.05)
    assert np.allclose(np.array(v.values), np.array(plain.values[..., :11, :]), atol=0.05)


@pytest.mark.parametrize("steps", [[20], [5, 1, 1, 6, 1, 7], [3] * 9])
def test_kv_view_of_rotating_cache_after_wrap_is_the_attended_window(steps):
    model = make_tiny_model("gemma3")  # sliding window 8 on two of three layers
    tokens = [int(t) for t in np.random.default_rng(0).integers(1, 60, sum(steps))]
    caches = make_prompt_cache(model)
    pos = 0
    for n in steps:  # in-place single-token updates and concatenating multi-token ones
        model(mx.array(tokens[pos : pos + n])[None], cache=caches)
        pos += n
    ref = _fed(model, tokens)  # one forward over everything
    for c, r in zip(caches, ref):
        v = specdec.kvview.kv_view(c)
        if type(c) is mlx_cache.RotatingKVCache:
            assert c.offset > c.max_size  # wrapped
            w = c.max_size - 1
            assert v.window == c.max_size and v.length == w
            assert v.positions == tuple(range(pos - w, pos))
            assert np.allclose(np.array(v.keys), np.array(r.keys[..., -w:, :]), atol=1e-5)
            assert np.allclose(np.array(v.values), np.array(r.values[..., -w:, :]), atol=1e-5)
            # the same window the kit's cache comparison sees
            kit = cache_view(c)
            assert np.array_equal(kit[1], np.array(v.keys))
            # full_window: the last `window` entries (a query without a key of its own)
            f = specdec.kvview.kv_view(c, full_window=True)
            w = c.max_size
            assert f.length == w and f.positions == tuple(range(pos - w, pos))
            assert np.allclose(np.array(f.keys), np.array(r.keys[..., -w:, :]), atol=1e-5)
            assert np.allclose(np.array(f.values), np.array(r.values[..., -w:, :]), atol=1e-5)
        else:
            assert v.length == pos
            assert specdec.kvview.kv_view(c, full_window=True).length == pos


def test_kv_view_during_propose_holds_history_but_the_last_token(models, copy_prompts):
    seen = []

    class Peek(specdec.BaseDrafter):
        name = "peek"
        needs = frozenset({"kv"})

        def session(self, ctx):
            outer = self

            class S(specdec.BaseDrafterSession):
                def propose(self, history, max_len):
                    views = specdec.kvview.kv_views(ctx.caches)
                    seen.append((len(history), views[0].offset, views[0].length))
                    return None

            del outer
            return S()

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("peek", Peek)

    with plugin_host(P()) as host:
        pipe = specdec.assemble(models["llama"], policy={"drafters": ["peek"]}, host=host)
        pipe.generate(copy_prompts["llama"], max_tokens=6)
    assert seen and all(off == n - 1 and length == n - 1 for n, off, length in seen)


# -- draft heads -----------------------------------------------------------------


def test_draft_head_is_built_once_and_shared(models):
    model = models["llama"]

    class Other(_NeedsHidden):
        name = "needs_hidden_2"

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("needs_hidden", _NeedsHidden)
            register("needs_hidden_2", Other)

    with plugin_host(P()) as host:
        pol = {"drafters": ["needs_hidden", "needs_hidden_2"], "verifier": "hidden"}
        p1 = specdec.assemble(model, policy=pol, host=host)
        p2 = specdec.assemble(model, policy=pol, host=host)
    assert p1.heads["needs_hidden"] is p1.heads["needs_hidden_2"] is p2.heads["needs_hidden"]
    assert isinstance(p1.heads["needs_hidden"], specdec.heads.ExactHead)
    out = p1.generate([1, 2, 3, 4, 1, 2, 3], max_tokens=4)
    assert out.stats.draft_heads["exact"]["calls"] > 0


def test_unknown_draft_head_is_named_with_the_installed_ones(models):
    with plugin_host(_NeedsHiddenPlugin()) as host:
        with pytest.raises(specdec.PolicyError) as e:
            specdec.assemble(
                models["llama"],
                policy={
                    "drafters": ["needs_hidden"],
                    "verifier": "hidden",
                    "options": {"needs_hidden": {"head": "nope"}},
                },
                host=host,
            )
    assert "'nope'" in str(e.value) and "exact" in str(e.value)


def test_draft_head_with_another_vocabulary_is_refused(models):
    class Small:
        name = "small_vocab"
        vocab_size = 7

        def logits(self, hidden):
            return mx.zeros((hidden.shape[0], 7))

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("needs_hidden", _NeedsHidden)

        @specdec.hookimpl
        def specdec_register_draft_heads(self, register):
            register("small_vocab", Small)

    with plugin_host(P()) as host:
        with pytest.raises(specdec.ModelLoadError, match=r"small_vocab.*7.*64"):
            specdec.assemble(
                models["llama"],
                policy={
                    "drafters": ["needs_hidden"],
                    "verifier": "hidden",
                    "options": {"needs_hidden": {"head": "small_vocab"}},
                },
                host=host,
            )


def test_exact_draft_head_is_a_builtin():
    host = specdec.get_plugin_host()
    info = host.components["draft_head"]["exact"]
    assert info.distribution == "specdec-core"
    assert isinstance(host.create("draft_head", "exact"), specdec.heads.ExactHead)


# -- one loop ------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_on_round_does_not_switch_the_plain_path(models, copy_prompts, temperature):
    pipe = specdec.assemble(models["qwen3"], policy="none")
    kw = dict(max_tokens=12, temperature=temperature, seed=3)
    plain = pipe.generate(copy_prompts["qwen3"], **kw)
    rounds = []
    hooked = pipe.generate(copy_prompts["qwen3"], on_round=lambda r, c: rounds.append(r), **kw)
    assert hooked.tokens == plain.tokens
    assert hooked.stats.target_forwards == plain.stats.target_forwards == len(rounds)
    assert all(r.drafter is None and len(r.committed) == 1 for r in rounds)
    assert hooked.stats.acceptors == plain.stats.acceptors  # the same decisions


def test_stats_report_the_loops_own_time(models, copy_prompts):
    with specdec.testing.plugin_host() as host:  # the kit's host has the oracle drafter
        pipe = specdec.assemble(models["llama"], policy=oracle_policy(models["llama"]), host=host)
        out = pipe.generate(copy_prompts["llama"], max_tokens=20)
    s = out.stats
    assert 0 < s.wait_time_s <= s.decode_time_s
    assert s.loop_overhead_s == pytest.approx((s.decode_time_s - s.wait_time_s) / s.target_forwards)
    assert "loop_overhead_s" in s.to_dict()


# -- fixes -----------------------------------------------------------------------


def test_greedy_acceptor_with_sampling_fails_before_prefill(models):
    calls = []
    model = models["llama"]

    class Spy:
        args = model.args

        def __call__(self, *a, **k):
            calls.append(1)
            return model(*a, **k)

        def make_cache(self):
            return make_prompt_cache(model)

    pipe = specdec.assemble(Spy(), policy={"acceptor": "greedy"})
    with pytest.raises(specdec.RequestError, match="acceptor 'greedy'.*temperature"):
        pipe.generate([1, 2, 3], temperature=0.7)
    assert calls == []


def test_type_error_inside_a_factory_is_not_reported_as_bad_options():
    def factory(block: int = 4):
        raise TypeError("a bug inside the factory")

    class P:
        @specdec.hookimpl
        def specdec_register_drafters(self, register):
            register("buggy", factory)

    with plugin_host(P()) as host:
        with pytest.raises(TypeError, match="a bug inside the factory"):
            host.create("drafter", "buggy", {"block": 2})
        with pytest.raises(
            specdec.PolicyError, match=r"bad options.*accepted options are \['block'\]"
        ):
            host.create("drafter", "buggy", {"nope": 2})


def test_declared_providers_register_what_they_declare():
    # Each plugin's entry-point group specdec_provides names what its distribution
    # registers (the core's error messages rely on it); the core itself names none.
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    host = specdec.get_plugin_host()
    checked = 0
    for p in (ROOT / "plugins").iterdir():
        if not (p / "pyproject.toml").is_file():
            continue
        project = tomllib.loads((p / "pyproject.toml").read_text())["project"]
        dist = project["name"]
        for name in project.get("entry-points", {}).get("specdec_provides", {}):
            registered = [
                c.distribution for t in host.components.values() for n, c in t.items() if n == name
            ]
            if name in host.presets:
                registered.append(host.presets[name].distribution)
            assert dist in registered, f"{dist} declares {name!r} but does not register it"
            checked += 1
    assert checked >= 5
    assert not hasattr(specdec.plugins, "KNOWN_PROVIDERS")


def test_draft_model_loads_are_tied_to_the_pipeline():
    import specdec.drafters.draft_model as dm

    assert not any(isinstance(v, dict) and k.isupper() for k, v in vars(dm).items()), (
        "draft_model keeps a module-level cache"
    )


# -- public API only ---------------------------------------------------------------

#: What a plugin may import from the core: the top level, the documented submodules
#: (the ones the 0.2 top-level names moved to, and the helpers plugins share), the kit.
PUBLIC = {
    "specdec",
    "specdec.checkpoints",
    "specdec.drafting",
    "specdec.hookspecs",
    "specdec.options",
    "specdec.testing",
    *(f"specdec.{m}" for m in set(specdec.MOVED.values())),
}


def _plugin_sources():
    for base in ("plugins", "docs/examples"):
        for pkg in (ROOT / base).iterdir():
            if not (pkg / "pyproject.toml").is_file():
                continue
            for f in pkg.rglob("*.py"):
                if "tests" not in f.relative_to(pkg).parts and "build" not in f.parts:
                    yield f


def test_plugin_sources_import_only_the_public_api():
    files = list(_plugin_sources())
    assert len(files) >= 5
    bad = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for n in names:
                if (n == "specdec" or n.startswith("specdec.")) and n not in PUBLIC:
                    bad.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {n}")
    assert not bad, "plugin sources import private core modules:\n" + "\n".join(bad)


def test_public_rollback_api(models):
    caches = make_prompt_cache(models["gemma3"])
    plan = specdec.rollback_plan(caches, model=models["gemma3"])
    assert plan.ok and set(plan.names()) == {"kv_trim", "rotating_window"}
    txn = plan.begin()
    models["gemma3"](mx.array([[1, 2, 3]]), cache=caches)
    txn.commit(3, 1)
    assert caches[0].offset == 1


def test_batch_policy_with_a_component_that_cannot_batch_fails_before_model_work():
    with plugin_host(SoloOnlyPlugin()) as host, pytest.raises(specdec.PolicyError) as e:
        specdec.assemble(
            "/no/such/model", policy={"drafters": ["solo_only"], "max_batch": 4}, host=host
        )
    msg = str(e.value)
    assert "decodes 4 rows of a batch" in msg and "drafter 'solo_only'" in msg
    assert "supports_batch" in msg and "ngram_copy" in msg and "oracle" in msg  # the ones that do
    with pytest.raises(specdec.PolicyError, match="max_batch must be an integer >= 1"):
        specdec.Policy(max_batch=0)
