"""``specdec train-assistant``: bad input before any model work, and an assistant the
default model then drafts with (greedy output unchanged)."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec.cli import main
from specdec.testing import make_tiny_model
from specdec_gemma4_mtp import AssistantLoadError
from specdec_train import STATE_FILE, SUMMARY_FILE


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--layers", "0"), "--layers must be >= 1"),
        (("--layers", "sliding,local"), "'local' is no layer type"),
        (("--hidden-size", "0"), "--hidden-size must be >= 1"),
        (("--centroids", "-1"), "--centroids must be >= 0"),
        (("--block-size", "1"), "--block-size must be >= 2"),
        (("--centroids", "8", "--top-k-centroids", "9"), "must be at most --centroids"),
        (("--steps", "0"), "--steps must be >= 1"),
        (("--resume",), "holds no training to resume"),
    ],
)
def test_bad_input_is_one_error_line_before_any_model_work(capsys, tmp_path, argv, message):
    code, cap = run(capsys, "train-assistant", "--out", str(tmp_path / "a"), *argv)
    assert code == 2 and message in cap.err and cap.err.startswith("specdec: error:")
    assert not (tmp_path / "a").exists()


def test_train_assistant_on_the_default_model_resume_and_draft_with_it(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "Write a Python function that adds two numbers.\nName three colors.\n"
        "Count from one to five.\n"
    )
    out = tmp_path / "assistant"
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
        "--centroids",
        "384",
        "--position",
        "last",
        "--no-progress",
    )
    code, cap = run(capsys, "train-assistant", *common, "--steps", "4")
    assert code == 0, cap.err
    assert "gemma4_mtp" in cap.out and str(out) in cap.out and "held out" in cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert (summary["prompts"], summary["held_out_prompts"]) == (3, 1)
    assert (summary["train_sequences"], summary["held_out_sequences"]) == (4, 2)
    # SmolLM2's tied head is affine: the candidate-set loss, scored with the assistant's
    # own embedding rows
    assert summary["loss"] == "sampled" and summary["steps"] == 4
    assert summary["last_loss"] < summary["first_loss"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma4_assistant" and config["backbone_hidden_size"] == 576
    assert config["num_centroids"] == 384 and config["use_ordered_embeddings"] is True
    assert config["specdec_target"] == summary["target"] and config["specdec_position"] == "last"
    assert (out / "model.safetensors").is_file()
    # Resumable: the saved step and data are picked up; the position must be the same.
    code, cap = run(capsys, "train-assistant", *common, "--steps", "6", "--resume")
    assert code == 0, cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["resumed_at"] == 4 and summary["steps"] == 6
    assert json.loads((out / STATE_FILE).read_text())["step"] == 6
    other = [a if a != "last" else "bonus" for a in common]
    code, cap = run(capsys, "train-assistant", *other, "--steps", "8", "--resume")
    assert code == 2 and "trained with --position last" in cap.err
    other = [a if a != "384" else "192" for a in common]
    code, cap = run(capsys, "train-assistant", *other, "--steps", "8", "--resume")
    assert code == 2 and "has --centroids 384" in cap.err
    # Drafting with it leaves the output as plain decoding's; its position is the one
    # it was trained for.
    pol = specdec.load_policy("gemma4").with_options("gemma4_mtp", assistant=str(out))
    pipe = specdec.assemble(None, policy=pol)
    prompt = pipe.encode_prompt("Name three colors.")
    res = pipe.generate(prompt, max_tokens=12)
    plain = specdec.assemble(None, policy="none").generate(prompt, max_tokens=12)
    assert res.tokens == plain.tokens
    st = res.stats.per_drafter["gemma4_mtp"]
    assert st["rounds"] > 0 and st["assistant"]["path"] == str(out)
    assert st["assistant"]["trained_by_specdec"] and st["assistant"]["position"] == "last"
    assert st["assistant"]["logits"] == "centroids" and st["assistant"]["donor_layers"] == {
        "full_attention": 29
    }
    # The assistant knows whose it is.
    with pytest.raises(AssistantLoadError, match="trained for another model|hidden size"):
        specdec.assemble(make_tiny_model("llama"), policy=pol)
