"""``specdec train-head``: bad input before any model work, and a head the default model
then drafts with (greedy output unchanged)."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest
import specdec
import specdec_train
from specdec.cli import main
from specdec.testing import check_greedy_identity, make_tiny_model, plain_greedy
from specdec_qwen_mtp_gdn.__main__ import held_out as held_out_main
from specdec_qwen_mtp_gdn.checkpoint import save_hf_checkpoint
from specdec_qwen_mtp_gdn.cli import STATE_FILE, SUMMARY_FILE
from specdec_qwen_mtp_gdn.mtp import MTPLoadError, load_mtp
from specdec_qwen_mtp_gdn.train import train_mtp_head


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--prompts", "/nonexistent.txt"), "is not a file"),
        (("--steps", "0"), "--steps must be >= 1"),
        (("--max-sequences", "1"), "--max-sequences must be >= 2"),
        (("--continue", "0"), "--continue must be >= 1"),
        (("--lr", "0"), "--lr must be > 0"),
        (("--held-out", "1"), "--held-out must be a fraction"),
        (("--resume",), "holds no training to resume"),
        (("--resume", "--force"), "exclude each other"),
    ],
)
def test_bad_input_is_one_error_line_before_any_model_work(capsys, tmp_path, argv, message):
    code, cap = run(capsys, "train-head", "--out", str(tmp_path / "h"), *argv)
    assert code == 2 and message in cap.err and cap.err.startswith("specdec: error:")
    assert not (tmp_path / "h").exists()


def test_a_non_empty_out_folder_needs_force_or_resume(capsys, tmp_path):
    (tmp_path / "x").write_text("keep me")
    code, cap = run(capsys, "train-head", "--out", str(tmp_path))
    assert code == 2 and "not empty" in cap.err and "--force" in cap.err and "--resume" in cap.err
    assert (tmp_path / "x").read_text() == "keep me"


def test_train_head_on_the_default_model_resume_and_draft_with_it(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "Write a Python function that adds two numbers.\nName three colors.\n"
        "Count from one to five.\n"
    )
    out = tmp_path / "head"
    common = (
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--continue",
        "12",
        "--answers",
        "2",
        "--save-every",
        "2",
        "--no-progress",
    )
    code, cap = run(capsys, "train-head", *common, "--steps", "4")
    assert code == 0, cap.err
    assert "mtp_path" in cap.out and str(out) in cap.out and "held out" in cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    # Two answers per prompt (greedy, sampled); a whole prompt is held out.
    assert (summary["prompts"], summary["held_out_prompts"]) == (3, 1)
    assert (summary["train_sequences"], summary["held_out_sequences"]) == (4, 2)
    assert summary["loss"] == "sampled" and not summary["stopped_by_time"]
    assert summary["steps"] == 4 and summary["last_loss"] < summary["first_loss"]
    assert 0 <= summary["held_out_top1"] <= 1
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index and all(k.startswith("mtp.") for k in index)
    config = json.loads((out / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["specdec_target"] == summary["target"]
    # Resumable: the saved step and data are picked up.
    code, cap = run(capsys, "train-head", *common, "--steps", "6", "--resume")
    assert code == 0, cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["resumed_at"] == 4 and summary["steps"] == 6
    assert json.loads((out / STATE_FILE).read_text())["step"] == 6
    # Drafting with it leaves the output as plain decoding's.
    pol = specdec.load_policy("mtp").with_options("qwen_mtp", mtp_path=str(out))
    pipe = specdec.assemble(None, policy=pol)
    prompt = pipe.encode_prompt("Name three colors.")
    res = pipe.generate(prompt, max_tokens=12)
    plain = specdec.assemble(None, policy="none").generate(prompt, max_tokens=12)
    assert res.tokens == plain.tokens
    st = res.stats.per_drafter["qwen_mtp"]
    assert st["mtp_rounds"] > 0 and st["mtp"]["path"] == str(out)
    assert st["mtp"]["trained_by_specdec"]
    # Per-position acceptance on the held-out prompt, at a fixed depth of 2.
    fixed = pol.with_options("qwen_mtp", depth=2, max_depth=2, adaptive=False)
    held = specdec_train.held_out_acceptance(out, fixed, "qwen_mtp", max_tokens=8)
    assert held["prompts"] == 1 and held["identical"]
    assert len(held["position_reached"]) == 2 and held["position_reached"][0] > 0
    assert held["position_accepted"][0] == round(
        held["position_acceptance"][0] * held["position_reached"][0]
    )
    assert held["conditional_acceptance"][0] == held["position_acceptance"][0]
    assert len(held["conditional_acceptance"]) == 2 and held["tokens_per_forward"] >= 1.0
    # The command line: the same figures as JSON, bad input as one error line.
    code = held_out_main([str(out), "--depth", "2", "--max-tokens", "8"])
    assert code == 0 and json.loads(capsys.readouterr().out) == held
    with pytest.raises(SystemExit) as exc:
        held_out_main([str(tmp_path / "nowhere")])
    assert exc.value.code == 2 and "cannot read" in capsys.readouterr().err
    with pytest.raises(specdec_train.TrainError, match="held-out prompts"):
        (out / specdec_train.DATA_FILE).write_text(json.dumps({"train": [[1, 2]]}))
        specdec_train.held_out_acceptance(out, fixed, "qwen_mtp")
    with pytest.raises(specdec_train.TrainError, match="cannot read"):
        specdec_train.held_out_acceptance(tmp_path / "nowhere", fixed, "qwen_mtp")
    # The head knows whose it is.
    with pytest.raises(MTPLoadError, match="trained for another model"):
        load_mtp(make_tiny_model("llama"), out)


def test_a_trained_head_drafts_for_a_llama_model(tmp_path):
    model = make_tiny_model("llama")
    rng = random.Random(0)
    seqs = []
    for _ in range(6):
        p = [rng.randrange(64) for _ in range(8)]
        seqs.append(p + plain_greedy(model, p, 56))
    head, st = train_mtp_head(model, seqs, steps=100)
    assert st["top1"] > 0.8
    with pytest.raises(ValueError, match="trunk=False"):
        save_hf_checkpoint(tmp_path / "all", model, head)
    save_hf_checkpoint(tmp_path / "head", model, head, trunk=False)
    pol = specdec.load_policy("mtp").with_options("qwen_mtp", mtp_path=str(tmp_path / "head"))
    totals = check_greedy_identity(model, pol, seqs[0][:8], max_tokens_list=(3, 40))
    assert totals["accepted"] > 0


def test_batched_answers_are_plain_greedy_and_record_the_targets_states():
    from specdec_train import batch_answers, record

    model = make_tiny_model("llama", vocab_size=64)
    prompts = [[3, 1, 4, 1, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2], [9]]
    answers, states = batch_answers(model, prompts, max_tokens=12, record=4, batch_size=2)
    for p, a, st in zip(prompts, answers, states):
        assert a == plain_greedy(model, p, 12)  # left padding changes nothing
        ref = record(model, p + a, top_k=4)
        n = st.hidden.shape[0]
        assert n == len(p + a) - 1  # the last token was never fed
        assert mx.allclose(st.hidden, ref.hidden[:n], atol=1e-4).item()
        assert (st.top1 == ref.top1[:n]).all().item()
    # An end-of-sequence token ends an answer and is kept out of it.
    eos = answers[0][3]
    cut, _ = batch_answers(model, prompts[:1], max_tokens=12, eos=[eos])
    assert cut[0] == answers[0][: answers[0].index(eos)]


def test_the_sampled_loss_is_the_full_one_where_the_candidates_cover_the_vocabulary():
    from specdec_qwen_mtp_gdn.mtp import QwenMTP
    from specdec_train import TargetOutput

    model = make_tiny_model("llama", vocab_size=64)
    assert TargetOutput(model).affine
    rng = random.Random(1)
    seqs = []
    for _ in range(3):
        p = [rng.randrange(64) for _ in range(6)]
        seqs.append(p + plain_greedy(model, p, 20))
    losses = {}
    for loss in ("sampled", "full"):
        mx.random.seed(0)
        init = QwenMTP(model, 1)  # the same start for both
        _, st = train_mtp_head(
            model, seqs, steps=1, init=init, loss=loss, candidates=64, mse_weight=0.0
        )
        losses[loss] = st["first_loss"]
    assert losses["sampled"] == pytest.approx(losses["full"], rel=1e-4)
    # A soft-capped output layer is not affine: 'auto' falls back to the full loss.
    gemma = make_tiny_model("gemma4", vocab_size=64)
    assert not TargetOutput(gemma).affine
    with pytest.raises(ValueError, match="affine"):
        train_mtp_head(gemma, seqs, steps=1, loss="sampled")


def test_training_stops_at_its_time_limit():
    model = make_tiny_model("llama", vocab_size=64)
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8]] * 2
    _, st = train_mtp_head(model, seqs, steps=10_000, time_limit=0.5, batch_size=1)
    assert st["stopped_by_time"] and 1 <= st["steps"] < 10_000


def test_resume_refuses_another_seed_or_batch_size(capsys, tmp_path):
    out = tmp_path / "head"
    out.mkdir()
    state = {"step": 2, "seed": 0, "batch_size": 8}
    prompts = tmp_path / "p.txt"
    prompts.write_text("Name three colors.\nCount to three.\n")
    from specdec_qwen_mtp_gdn.cli import DATA_FILE
    from specdec_qwen_mtp_gdn.mtp import target_identity

    pipe = specdec.assemble(None, policy="none")
    state["target"] = target_identity(pipe.model)
    (out / STATE_FILE).write_text(json.dumps(state))
    (out / DATA_FILE).write_text(json.dumps({"train": [[1, 2, 3]], "held_out": [[1, 2, 3]]}))
    for flag, value in (("--seed", "1"), ("--batch-size", "4")):
        code, cap = run(capsys, "train-head", "--out", str(out), "--resume", flag, value)
        assert code == 2 and f"ran with {flag}" in cap.err, cap.err


def test_train_head_on_an_earlier_runs_data(capsys, tmp_path):
    """--data: another head on the sequences of an earlier run (train-assistant's, say),
    without the model answering again; a file that is not such data is refused first."""
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train": [[1, 2, 3]]}))
    code, cap = run(capsys, "train-head", "--out", str(tmp_path / "x"), "--data", str(bad))
    assert code == 2 and "is not a train_data.json" in cap.err
    code, cap = run(
        capsys, "train-head", "--out", str(tmp_path / "x"), "--data", str(bad), "--resume"
    )
    assert code == 2 and "exclude each other" in cap.err
    data = tmp_path / "train_data.json"
    seqs = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
    data.write_text(json.dumps({"train": seqs, "held_out": [[5, 6, 7, 8, 9]]}))
    out = tmp_path / "head"
    code, cap = run(
        capsys,
        "train-head",
        "--out",
        str(out),
        "--data",
        str(data),
        "--steps",
        "2",
        "--save-every",
        "1",
        "--no-progress",
    )
    assert code == 0, cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["train_sequences"] == 2 and summary["held_out_sequences"] == 1
    assert summary["steps"] == 2
    assert json.loads((out / "train_data.json").read_text())["train"] == seqs
