"""``specdec train-dflash``: bad input before any model work, and a drafter the default
model then drafts with (greedy output unchanged), resumable, refused for another model."""

from __future__ import annotations

import json

import pytest
import specdec
from specdec.cli import main
from specdec.testing import make_tiny_model
from specdec_dflash import DFlashLoadError
from specdec_train import STATE_FILE, SUMMARY_FILE


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--layers", "0"), "--layers must be >= 1"),
        (("--block-size", "1"), "--block-size must be >= 2"),
        (("--mask-token", "-1"), "--mask-token must be >= 0"),
        (("--anchors", "0"), "--anchors must be >= 1"),
        (("--gamma", "0"), "--gamma must be > 0"),
        (("--target-layers", "1,x"), "give 0-based layer indices"),
        (("--target-layers", "2,2"), "give distinct 0-based layer indices"),
        (("--steps", "0"), "--steps must be >= 1"),
        (("--resume",), "holds no training to resume"),
    ],
)
def test_bad_input_is_one_error_line_before_any_model_work(capsys, tmp_path, argv, message):
    code, cap = run(capsys, "train-dflash", "--out", str(tmp_path / "d"), *argv)
    assert code == 2 and message in cap.err and cap.err.startswith("specdec: error:")
    assert not (tmp_path / "d").exists()


def test_train_dflash_on_the_default_model_resume_and_draft_with_it(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "Write a Python function that adds two numbers.\nName three colors.\n"
        "Count from one to five.\n"
    )
    out = tmp_path / "drafter"
    common = (
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--continue",
        "16",
        "--answers",
        "2",
        "--save-every",
        "2",
        "--block-size",
        "6",
        "--target-layers",
        "2,15,27",
        "--anchors",
        "8",
        "--no-progress",
    )
    code, cap = run(capsys, "train-dflash", *common, "--steps", "4")
    assert code == 0, cap.err
    assert "dflash" in cap.out and str(out) in cap.out and "held out" in cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert (summary["prompts"], summary["held_out_prompts"]) == (3, 1)
    assert (summary["train_sequences"], summary["held_out_sequences"]) == (4, 2)
    # SmolLM2's tied head is affine: the candidate-set loss
    assert summary["loss"] == "sampled" and summary["steps"] == 4
    assert summary["last_loss"] < summary["first_loss"]
    # acceptance per block position, held out: one per draft slot, never rising
    held = summary["held_out_position_acceptance"]
    assert len(held) == 5 and all(a >= b for a, b in zip(held, held[1:]))
    config = json.loads((out / "config.json").read_text())
    assert config["block_size"] == 6 and config["num_target_layers"] == 30
    assert config["dflash_config"]["target_layer_ids"] == [2, 15, 27]
    assert config["dflash_config"]["mask_token_id"] == 49151
    assert config["specdec_target"] == summary["target"]
    assert (out / "model.safetensors").is_file()
    # the prompts' lengths go with the data: blocks are drawn on the answers only
    data = json.loads((out / "train_data.json").read_text())
    for k in ("train", "held_out"):
        lengths = data[f"{k}_prompt_lengths"]
        assert len(lengths) == len(data[k]) and all(
            0 < n < len(s) for n, s in zip(lengths, data[k])
        )
    # Resumable: the saved step and data are picked up; the shape must be the same.
    code, cap = run(capsys, "train-dflash", *common, "--steps", "6", "--resume")
    assert code == 0, cap.err
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["resumed_at"] == 4 and summary["steps"] == 6
    assert json.loads((out / STATE_FILE).read_text())["step"] == 6
    other = [a if a != "6" else "8" for a in common]
    code, cap = run(capsys, "train-dflash", *other, "--steps", "8", "--resume")
    assert code == 2 and "has --block-size 6" in cap.err
    code, cap = run(capsys, "train-dflash", *common, "--steps", "8", "--resume", "--gamma", "2")
    assert code == 2 and "has --gamma 4.0" in cap.err
    assert config["specdec_train_dflash"] == {"anchors": 8, "gamma": 4.0, "init": "target"}
    # Drafting with it leaves the output as plain decoding's (fixed sizing: every round
    # drafts, whatever the estimates say).
    pol = specdec.load_policy("dflash").with_options("dflash", path=str(out), sizing="fixed")
    pipe = specdec.assemble(None, policy=pol)
    prompt = pipe.encode_prompt("Name three colors.")
    res = pipe.generate(prompt, max_tokens=12)
    plain = specdec.assemble(None, policy="none").generate(prompt, max_tokens=12)
    assert res.tokens == plain.tokens
    st = res.stats.per_drafter["dflash"]
    assert st["dflash_rounds"] > 0 and st["dflash_proposed"] > 0
    # The drafter knows whose it is: another model is refused before any weight is read.
    with pytest.raises(DFlashLoadError, match="trained for another model|trained for a target"):
        specdec.assemble(make_tiny_model("llama"), policy=pol)


def test_a_new_drafter_starts_from_the_targets_last_layers_quantized_or_not():
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from specdec_dflash.train import new_dflash

    target = make_tiny_model("llama")
    q = type(target)(target.args)  # a copy of its own (the kit's models are shared)
    q.update(target.parameters())
    nn.quantize(q, group_size=32, bits=8)
    for model in (target, q):
        m = new_dflash(model, layers=1, target_layer_ids=[0, 1], mask_token_id=3)
        donor = model.model.layers[-1].self_attn.q_proj
        want = (
            mx.dequantize(donor.weight, donor.scales, donor.biases, 32, 8)
            if isinstance(donor, nn.QuantizedLinear)
            else donor.weight
        )
        np.testing.assert_allclose(
            np.asarray(m.layers[0].self_attn.q_proj.weight), np.asarray(want), atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(m.norm.weight), np.asarray(model.model.norm.weight), atol=1e-6
        )
        H = m.config.hidden_size  # fc passes the last conditioning layer through
        np.testing.assert_allclose(np.asarray(m.fc.weight[:, H:]), np.eye(H), atol=0)
        assert not np.asarray(m.fc.weight[:, :H]).any()
