"""The ``specdec`` command: plugins, doctor, generate, and bad input.

Runs the CLI in-process through ``specdec.cli.main([...])`` and, once per
command family, through the installed console script. ``generate`` runs on a
tiny random llama saved to a temporary folder with a word-level tokenizer
(no network).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import specdec
from core_support import write_random_llama
from specdec import blas
from specdec.cli import build_parser, build_policy, format_stats_line, main
from specdec.plugins import PluginHost

WORDS = (
    "user assistant system : . , the a cat dog sat on mat and ran to house "
    "hello world is big small red blue one two three"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)
PROMPT = "the cat sat on the mat"
STATS_KEYS = {
    "target_forwards",
    "drafted",
    "accepted",
    "tokens_per_forward",
    "acceptance_rate",
    "prompt_tps",
    "decode_tps",
    "peak_memory_gb",
    "per_drafter",
    "speculation_off_reason",
}


def write_tiny_model(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer llama with random weights and a word-level tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
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
        vocab_size=len(vocab),
        tie_word_embeddings=True,
        rope_theta=10000.0,
        max_position_embeddings=512,
    )
    write_random_llama(path, config, seed=seed)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Plain mlx-lm greedy decoding of PROMPT through the chat template."""
    import mlx_lm

    model, tok = mlx_lm.load(str(tiny_model))
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)

    def run(max_tokens: int) -> str:
        return mlx_lm.generate(model, tok, ids, max_tokens=max_tokens)

    return run


@pytest.fixture
def no_model_loading(monkeypatch):
    """Fail the test if the CLI tries to load a model."""

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(specdec, "assemble", boom)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def console_script() -> list[str]:
    """The installed ``specdec`` console script (next to this interpreter, else on PATH)."""
    exe = Path(sys.executable).parent / "specdec"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("specdec")
    if found:
        return [found]
    pytest.fail("the specdec console script is not installed (pip install -e .)")


def run_script(*argv: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*console_script(), *argv],
        capture_output=True,
        text=True,
        input=stdin if stdin is not None else "",
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def assert_usage_error(rc: int, out: str, err: str, needle: str) -> None:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) >= 1 and lines[0].startswith("specdec: error: "), err
    assert needle in err, err
    assert out == "", out


# -- top level -------------------------------------------------------------------


def test_help_and_version(capsys):
    rc, out, _ = run_cli(capsys, "--help")
    assert rc == 0
    for cmd in ("generate", "plugins", "doctor"):
        assert cmd in out
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and specdec.__version__ in out


def test_no_command_is_a_usage_error(capsys):
    rc, out, err = run_cli(capsys)
    assert rc == 2
    assert err.startswith("specdec: error: ")


def test_unknown_command(capsys):
    rc, out, err = run_cli(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err and "Traceback" not in err


# -- plugins -----------------------------------------------------------------------


def test_plugins_json_all_lists_builtins(capsys):
    rc, out, _ = run_cli(capsys, "plugins", "--all", "--json")
    assert rc == 0
    info = json.loads(out)
    assert set(info) >= {"core_version", "plugins", "failures"}
    core = [p for p in info["plugins"] if p["distribution"] == "specdec-core"]
    assert core, info
    comps = {role: set(names) for p in core for role, names in p["components"].items()}
    assert "draft_model" in comps.get("drafter", set())
    assert comps.get("acceptor"), comps
    assert comps.get("verifier"), comps
    assert comps.get("cache_rollback"), comps
    for p in info["plugins"]:
        assert set(p) >= {"name", "distribution", "version", "components"}


def test_plugins_json_hides_builtins_without_all(capsys):
    rc, out, _ = run_cli(capsys, "plugins", "--json")
    assert rc == 0
    info = json.loads(out)
    assert all(p["distribution"] != "specdec-core" for p in info["plugins"])


def test_plugins_text(capsys):
    rc, out, _ = run_cli(capsys, "plugins", "--all")
    assert rc == 0
    assert out.startswith("specdec-core ")
    assert "drafter: " in out and "draft_model" in out


def test_plugins_allow_list_empty(capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_PLUGINS", "")
    specdec.plugins.reset_plugin_host()
    try:
        rc, out, _ = run_cli(capsys, "plugins")
        assert rc == 0
        assert "no third-party plugins" in out
    finally:
        monkeypatch.delenv("SPECDEC_PLUGINS")
        specdec.plugins.reset_plugin_host()


def test_plugins_failures_are_shown(capsys, monkeypatch):
    fake = {
        "core_version": "0.2.0",
        "plugins": [],
        "failures": [
            {
                "entry_point": "broken",
                "distribution": "specdec-plugin-broken",
                "version": "9.9",
                "core_version": "0.2.0",
                "error": "ImportError: no module named nope",
            }
        ],
    }

    class Host:
        def to_dict(self, include_builtins=True):
            return fake

    monkeypatch.setattr(specdec, "get_plugin_host", lambda: Host())
    rc, out, _ = run_cli(capsys, "plugins")
    assert rc == 0
    assert "failed to load:" in out
    assert "specdec-plugin-broken 9.9" in out and "ImportError: no module named nope" in out


# -- doctor ------------------------------------------------------------------------


def test_doctor_json_fields(capsys):
    rc, out, _ = run_cli(capsys, "doctor", "--json")
    assert rc == 0
    r = json.loads(out)
    for key in (
        "specdec_core",
        "python",
        "mlx",
        "mlx_lm",
        "device",
        "blas",
        "matmul_gflops",
        "plugins",
        "plugin_failures",
    ):
        assert key in r, key
    assert r["python"]["version"].count(".") == 2
    assert r["mlx"] and r["mlx_lm"]
    assert r["device"].startswith("Device(")
    b = r["blas"]
    for key in ("active", "loaded_libraries", "fast_blas_candidates", "ensure_fast_blas"):
        assert key in b, key
    assert r["matmul_gflops"] > 0
    att = r["verify_attention"]
    # the suite pins the replica on (SPECDEC_CPU_ATTENTION=on, see conftest): untimed
    assert att["replica"] is True and "bit-identical" in att["reason"], att
    assert set(att) == {"replica", "reason", "speedup", "description"}
    assert b["matmul_max_abs_error"] < 1e-3
    assert any(p["distribution"] == "specdec-core" for p in r["plugins"])
    if sys.platform.startswith("linux"):
        assert b["loaded_libraries"]
        # in this process specdec was imported before mlx, so a fast BLAS (if any) is in use
        if b["fast_blas_candidates"] and not blas.fast_blas_disabled():
            assert blas.is_fast_blas(b["active"]), b


def test_doctor_text(capsys):
    rc, out, _ = run_cli(capsys, "doctor")
    assert rc == 0
    for label in ("mlx ", "mlx-lm", "device", "blas in use", "matmul", "GFLOP/s", "plugins"):
        assert label in out, label
    # the CPU's verify attention: which one, and why (CI runs the Linux mlx-cpu wheel)
    assert "attention     verify forwards use a replica of MLX's softmax (bit-identical" in out


def test_console_script_doctor_and_plugins():
    proc = run_script("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["blas"]["active"] is None or os.path.exists(r["blas"]["active"])
    if r["blas"]["fast_blas_candidates"]:
        assert blas.is_fast_blas(r["blas"]["active"]), r["blas"]
    proc = run_script("plugins", "--all", "--json")
    assert proc.returncode == 0, proc.stderr
    assert any(p["distribution"] == "specdec-core" for p in json.loads(proc.stdout)["plugins"])


# -- generate: bad input --------------------------------------------------------------


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--max-tokens", "-3"], "max_tokens"),
        (["--max-tokens", "ten"], "invalid int value"),
        (["--temp", "-0.5"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-1"], "top_k"),
        (["--min-p", "2"], "min_p"),
        (["--policy", "no-such-preset"], "unknown policy 'no-such-preset'"),
        (["--policy", "/nonexistent/policy.toml"], "cannot read policy file"),
        (["--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["--draft-model", "/nonexistent/draft"], "--draft-model"),
        (["--num-draft-tokens", "3"], "no draft_model drafter"),
        (["--policy", "copy", "--num-draft-tokens", "3"], "--draft-model"),
    ],
)
def test_generate_bad_input(capsys, no_model_loading, tiny_model, args, needle):
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model), "--prompt", "hi", *args)
    assert_usage_error(rc, out, err, needle)


def test_generate_missing_model_path(capsys, no_model_loading, tmp_path):
    missing = tmp_path / "no-such-model"
    rc, out, err = run_cli(capsys, "generate", "--model", str(missing), "--prompt", "hi")
    assert_usage_error(rc, out, err, "no such folder")
    assert str(missing) in err


def test_generate_model_is_a_file(capsys, no_model_loading, tmp_path):
    f = tmp_path / "model.bin"
    f.write_text("x")
    rc, out, err = run_cli(capsys, "generate", "--model", str(f), "--prompt", "hi")
    assert_usage_error(rc, out, err, "is a file")


def test_generate_malformed_policy_toml(capsys, no_model_loading, tiny_model, tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("drafters = [\n")
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model), "--policy", str(p))
    assert_usage_error(rc, out, err, "not valid TOML")


def test_generate_policy_with_unknown_component(capsys, no_model_loading, tiny_model, tmp_path):
    p = tmp_path / "unknown.toml"
    p.write_text('drafters = ["no_such_drafter"]\n')
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model), "--policy", str(p))
    assert_usage_error(rc, out, err, "no_such_drafter")


def test_generate_empty_stdin(capsys, no_model_loading, tiny_model, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("  \n"))
    rc, out, err = run_cli(capsys, "generate", "--model", str(tiny_model), "--prompt", "-")
    assert_usage_error(rc, out, err, "empty prompt")


def test_generate_validates_before_default_model(capsys, no_model_loading, monkeypatch):
    fake = types.ModuleType("specdec.models.default")

    def default_model_path(**kwargs):
        raise AssertionError("the default model was prepared before the input was validated")

    fake.default_model_path = default_model_path
    monkeypatch.setitem(sys.modules, "specdec.models.default", fake)
    rc, out, err = run_cli(capsys, "generate", "--max-tokens", "0")
    assert_usage_error(rc, out, err, "max_tokens")


def test_generate_default_model_unavailable(capsys, no_model_loading, monkeypatch):
    fake = types.ModuleType("specdec.models.default")

    def default_model_path(**kwargs):
        raise RuntimeError("the default model package is not installed")

    fake.default_model_path = default_model_path
    monkeypatch.setitem(sys.modules, "specdec.models.default", fake)
    rc, out, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert_usage_error(rc, out, err, "built-in default model")
    assert "not installed" in err and "--model" in err


def test_console_script_bad_input_exits_2():
    proc = run_script("generate", "--max-tokens", "0", "--prompt", "hi")
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("specdec: error: max_tokens"), proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_script("generate", "--model", "/nonexistent/model", "--prompt", "hi")
    assert proc.returncode == 2 and "no such folder" in proc.stderr, proc.stderr


# -- generate: real runs on the tiny model ------------------------------------------


def test_generate_streams_plain_greedy_text(capsys, tiny_model, reference):
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model), "--prompt", PROMPT, "--max-tokens", "12"
    )
    assert rc == 0, err
    assert out == reference(12) + "\n"


def test_generate_json(capsys, tiny_model, reference):
    rc, out, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_model),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "10",
        "--json",
        "--policy",
        "none",
    )
    assert rc == 0, err
    obj = json.loads(out)  # exactly one JSON object on stdout
    assert set(obj) >= {"text", "tokens", "stats"}
    assert obj["text"] == reference(10)
    assert 1 <= len(obj["tokens"]) <= 10
    if obj.get("finish_reason") == "length":
        assert len(obj["tokens"]) == 10
    assert STATS_KEYS <= set(obj["stats"]), set(obj["stats"])
    assert obj["stats"]["speculation_off_reason"]  # policy "none" has no drafter


def test_generate_runs_the_copy_preset_by_default_and_says_so(capsys, tiny_model, reference):
    # The plugins of the copy preset are installed in the test environment.
    assert specdec.default_policy().name == "copy"
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model), "--prompt", PROMPT, "-m", "10", "--json"
    )
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["policy"] == "copy" and obj["text"] == reference(10)
    assert "ngram_copy" in obj["stats"]["per_drafter"]
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model), "--prompt", PROMPT, "-m", "6", "--stats"
    )
    assert rc == 0, err
    assert "policy=copy" in err
    # Without the plugins, the default is plain decoding.
    bare = PluginHost(load_entry_points=False)
    assert specdec.default_policy(bare).name == "none"
    assert specdec.load_policy("default", host=bare).name == "none"
    assert specdec.load_policy(None).name == "none"


def test_generate_stats_line(capsys, tiny_model):
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model), "--prompt", PROMPT, "-m", "8", "--stats"
    )
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("specdec: ")]
    assert len(lines) == 1, err
    line = lines[0]
    assert "decode" in line and "tok/s" in line
    assert "tokens/forward" in line and "acceptance" in line


def test_generate_draft_model_accepts_everything_and_keeps_text(capsys, tiny_model, reference):
    rc, out, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_model),
        "--draft-model",
        str(tiny_model),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "12",
        "--json",
    )
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["text"] == reference(12)
    st = obj["stats"]
    assert st["drafted"] > 0 and st["accepted"] == st["drafted"]
    assert st["acceptance_rate"] == pytest.approx(1.0)
    assert st["tokens_per_forward"] > 1.0
    assert "draft_model" in st["per_drafter"]


def _generate_policy(*argv: str):
    """The policy ``specdec generate ARGV`` runs (nothing is loaded)."""
    return build_policy(build_parser().parse_args(["generate", *argv]))


def test_draft_model_without_a_policy_drafts_alone_and_says_so(tiny_model):
    # the default policy (copy here) is not combined with a draft model nobody asked
    # to combine: the draft preset runs, under its own name
    pol = _generate_policy("--draft-model", str(tiny_model))
    assert pol.drafters == ("draft_model",) and pol.name == "draft"
    assert pol.options_for("draft_model")["model"] == str(tiny_model)
    both = _generate_policy("--policy", "copy", "--draft-model", str(tiny_model))
    assert both.drafters == ("ngram_copy", "draft_model") and both.name == "copy+draft_model"


@pytest.mark.parametrize("policy", ["none", "draft", "copy"])
@pytest.mark.parametrize("n", [1, 6, 20])
def test_num_draft_tokens_sets_the_draft_model_drafter(tiny_model, policy, n):
    """--num-draft-tokens N: the draft_model drafter drafts N per round (its option), and
    max_block lets a block of N through (it used to set only max_block, leaving the
    drafter at its default 4)."""
    base = specdec.load_policy(policy)
    pol = _generate_policy(
        "--policy", policy, "--draft-model", str(tiny_model), "--num-draft-tokens", str(n)
    )
    assert "draft_model" in pol.drafters
    opts = pol.options_for("draft_model")
    assert opts["num_draft_tokens"] == n
    assert opts["model"] == str(tiny_model)
    assert pol.max_block == max(base.max_block, n)
    assert pol.min_block <= n
    # without the flag the drafter keeps its own default and the policy its blocks
    plain = _generate_policy("--policy", policy, "--draft-model", str(tiny_model))
    assert "num_draft_tokens" not in plain.options_for("draft_model")
    assert (plain.max_block, plain.min_block) == (base.max_block, base.min_block)


def test_num_draft_tokens_drafts_that_many_per_round(capsys, tiny_model, reference):
    """End to end: with the draft model equal to the target every draft is accepted, so
    every round drafts exactly N (more than the drafter's default 4, which the old
    mapping left in place: 3 rounds of 4 here)."""
    # the prompt's forward gives the first token, then two rounds of 6 drafted + 1 bonus
    n, max_tokens = 6, 15
    rc, out, err = run_cli(
        capsys,
        "generate",
        "--model",
        str(tiny_model),
        "--draft-model",
        str(tiny_model),
        "--num-draft-tokens",
        str(n),
        "--prompt",
        PROMPT,
        "--max-tokens",
        str(max_tokens),
        "--json",
    )
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["text"] == reference(max_tokens)
    pd = obj["stats"]["per_drafter"]["draft_model"]
    assert pd["rounds"] >= 1 and pd["accepted"] == pd["drafted"], pd
    assert pd["drafted"] == n * pd["rounds"], pd  # N drafted per round


def test_generate_prompt_from_stdin(capsys, tiny_model, monkeypatch, reference):
    monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT))
    rc, out, err = run_cli(
        capsys, "generate", "--model", str(tiny_model), "--prompt", "-", "--max-tokens", "6"
    )
    assert rc == 0, err
    assert out == reference(6) + "\n"


def test_generate_chat_template_flags(capsys, tiny_model):
    def prompt_tokens(*extra: str) -> int:
        rc, out, err = run_cli(
            capsys,
            "generate",
            "--model",
            str(tiny_model),
            "--prompt",
            PROMPT,
            "-m",
            "2",
            "--json",
            *extra,
        )
        assert rc == 0, err
        st = json.loads(out)["stats"]
        assert "prompt_tokens" in st, sorted(st)
        return st["prompt_tokens"]

    raw = prompt_tokens("--ignore-chat-template")
    chat = prompt_tokens()
    system = prompt_tokens("--system-prompt", "be small")
    assert raw == len(PROMPT.split())
    assert chat > raw
    assert system > chat


def test_generate_seeded_sampling_is_reproducible(capsys, tiny_model):
    def tokens() -> list[int]:
        rc, out, err = run_cli(
            capsys,
            "generate",
            "--model",
            str(tiny_model),
            "--prompt",
            PROMPT,
            "-m",
            "12",
            "--temp",
            "1.0",
            "--top-p",
            "0.9",
            "--seed",
            "7",
            "--json",
        )
        assert rc == 0, err
        return json.loads(out)["tokens"]

    assert tokens() == tokens()


def test_console_script_generate(tiny_model, reference):
    proc = run_script("generate", "--model", str(tiny_model), "--prompt", PROMPT, "-m", "5")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference(5) + "\n"


def test_format_stats_line_without_drafts():
    line = format_stats_line(
        {
            "decode_tps": 12.5,
            "prompt_tps": 100.0,
            "tokens_per_forward": 1.0,
            "acceptance_rate": 0.0,
            "drafted": 0,
            "accepted": 0,
            "target_forwards": 4,
            "speculation_off_reason": "policy 'none' has no drafters",
        },
        policy="none",
        generated=4,
    )
    assert "acceptance n/a" in line and "12.5 tok/s" in line and "speculation off" in line


# -- doctor --model: the verify cost curve ----------------------------------------------


def test_doctor_model_prints_the_verify_cost_curve(capsys, tiny_model, tmp_path, monkeypatch):
    from specdec.costs import CostModel

    monkeypatch.setattr(CostModel, "_memory", {})
    monkeypatch.setattr("specdec.costs.cache_dir", lambda: tmp_path)
    rc, out, err = run_cli(capsys, "doctor", "--model", str(tiny_model), "--json")
    assert rc == 0, err
    vc = json.loads(out)["verify_cost"]
    assert vc["source"] == "profiled" and Path(vc["path"]).is_file()
    assert str(tmp_path) in vc["path"]
    curve = vc["curve"]
    assert curve["widths"][0] == 1 and len(curve["seconds"]) == len(curve["contexts"])
    assert "profiling the verify cost" in err  # a progress line for the long step
    monkeypatch.setattr(CostModel, "_memory", {})
    rc, out, _ = run_cli(capsys, "doctor", "--model", str(tiny_model))
    assert rc == 0
    assert "verify cost of" in out and "(disk;" in out and "1-step ms" in out
    rc, out, _ = run_cli(capsys, "doctor", "--model", str(tiny_model), "--reprofile", "--json")
    assert rc == 0 and json.loads(out)["verify_cost"]["source"] == "profiled"


def test_doctor_model_builds_the_named_draft_heads(capsys, tiny_model, tmp_path, monkeypatch):
    from specdec.costs import CostModel

    monkeypatch.setattr(CostModel, "_memory", {})
    monkeypatch.setattr("specdec.costs.cache_dir", lambda: tmp_path)
    rc, out, err = run_cli(
        capsys, "doctor", "--model", str(tiny_model), "--head", "exact", "--json"
    )
    assert rc == 0, err
    (h,) = json.loads(out)["heads"]
    assert h["head"] == "exact" and h["options"] == {} and h["stats"]["kind"] == "exact"
    rc, out, _ = run_cli(capsys, "doctor", "--model", str(tiny_model), "--head", "exact")
    assert rc == 0 and "draft head exact (defaults) for" in out and "kind: exact" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--head", "exact"], "--head needs --model"),
        (["--model", "/no/such", "--head", "exact:kind"], "'kind' is not OPTION=VALUE"),
        (["--model", "/no/such", "--head", ":a=1"], "no head name"),
    ],
)
def test_doctor_head_errors_before_model_work(capsys, args, needle):
    rc, _, err = run_cli(capsys, "doctor", *args)
    assert rc != 0 and needle in err


def test_doctor_unknown_head_or_option_is_named_before_the_model_is_loaded(capsys):
    rc, _, err = run_cli(capsys, "doctor", "--model", "/no/such/model", "--head", "nope")
    assert rc != 0 and "'nope'" in err and "exact" in err and "/no/such" not in err
    rc, _, err = run_cli(capsys, "doctor", "--model", "/no/such/model", "--head", "exact:x=1")
    assert rc != 0 and "x" in err and "/no/such" not in err


def test_parse_head_spec_values():
    from specdec.cli.info import parse_head_spec

    assert parse_head_spec("coarse_head:kind=pruned, keep=8192,context_tokens=false,x=0.5") == (
        "coarse_head",
        {"kind": "pruned", "keep": 8192, "context_tokens": False, "x": 0.5},
    )


def test_doctor_reprofile_needs_a_model(capsys):
    rc, _, err = run_cli(capsys, "doctor", "--reprofile")
    assert rc != 0 and "--reprofile needs --model" in err


# -- subcommands from plugins (the specdec_register_commands hook) ----------------------


def test_hook_specdec_register_commands(capsys):
    from specdec.testing import plugin_host

    ran = []

    class Hello:
        @specdec.hookimpl
        def specdec_register_commands(self, subparsers):
            p = subparsers.add_parser("hello", help="say hello")
            p.add_argument("--who", default="world")
            p.set_defaults(func=lambda a: ran.append(a.who) or 0)

            def fails(args):
                raise specdec.PolicyError("bad thing, use a good thing")

            subparsers.add_parser("fails").set_defaults(func=fails)

    class Taken:
        @specdec.hookimpl
        def specdec_register_commands(self, subparsers):
            subparsers.add_parser("generate")  # the core's

    class Broken:
        @specdec.hookimpl
        def specdec_register_commands(self, subparsers):
            subparsers.add_parser("half")
            raise RuntimeError("plugin bug")

    class Alias:
        @specdec.hookimpl
        def specdec_register_commands(self, subparsers):
            subparsers.add_parser("gen2", aliases=["bench"])  # an alias that is taken

    with plugin_host(Hello(), Taken(), Broken(), Alias(), load_entry_points=False):
        assert main(["hello", "--who", "you"]) == 0 and ran == ["you"]
        err = capsys.readouterr().err
        assert "command 'generate' is left out: the name is taken" in err
        assert "could not be added: RuntimeError: plugin bug" in err
        assert main(["fails"]) == 2
        assert "specdec: error: bad thing, use a good thing" in capsys.readouterr().err
        assert "command 'bench' is left out: the name is taken" in err
        assert main(["half"]) == 2 and main(["gen2"]) == 2  # left out altogether
        capsys.readouterr()
        assert main(["--help"]) == 0
        listed = capsys.readouterr().out
        assert "hello" in listed and "half" not in listed and "gen2" not in listed
        assert main(["generate", "--help"]) == 0  # the core's generate is intact
        assert "--draft-model" in capsys.readouterr().out
