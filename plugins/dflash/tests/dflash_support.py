"""Tiny DFlash checkpoints written in the published on-disk layout, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from specdec_dflash.checkpoint import target_shape
from specdec_dflash.model import DFlashConfig, DFlashModel


def tiny_config(target, *, layers: int = 2, ids=(0, 1), block: int = 8, mask: int = 3) -> dict:
    """A ``config.json`` dict as z-lab's drafters have it, for ``target``'s shapes."""
    hidden, n_target, vocab = target_shape(target)
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": vocab,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(ids)},
    }


def config_of(cfg: dict) -> DFlashConfig:
    d = cfg["dflash_config"]
    return DFlashConfig(
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"],
        vocab_size=cfg["vocab_size"],
        attention_bias=cfg["attention_bias"],
        block_size=cfg["block_size"],
        mask_token_id=d["mask_token_id"],
        target_layer_ids=tuple(d["target_layer_ids"]),
        num_target_layers=cfg["num_target_layers"],
    )


def write_checkpoint(
    folder: Path, cfg: dict, *, seed: int = 0, prefix: str = "", shards: int = 1
) -> DFlashModel:
    """Random weights for ``cfg`` (normal, std 0.2; norms near 1) saved as
    ``model.safetensors`` (or ``shards`` files with an index), names prefixed by
    ``prefix``; returns the model."""
    folder.mkdir(parents=True, exist_ok=True)
    model = DFlashModel(config_of(cfg))
    mx.random.seed(seed)
    model.update(tree_map(lambda p: 0.2 * mx.random.normal(p.shape), model.parameters()))
    flat = dict(tree_flatten(model.parameters()))
    for name in flat:
        if name.endswith("norm.weight"):
            flat[name] = 1.0 + 0.1 * mx.random.normal(flat[name].shape)
    model.load_weights(list(flat.items()))
    names = sorted(flat)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), {prefix + n: flat[n] for n in names})
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            mx.save_safetensors(str(folder / fname), {prefix + n: flat[n] for n in part})
            weight_map.update({prefix + n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return model


def trained_drafter(target, folder: Path, out: Path, prompts, *, steps: int = 150, policy="none"):
    """The drafter in ``folder`` self-distilled for seconds on ``target``'s greedy answers
    to ``prompts`` (40 tokens each), saved to ``out``; returns the losses per step and
    :func:`specdec_dflash.train.train_dflash`'s result."""
    import specdec
    from specdec_dflash import load_dflash
    from specdec_dflash.train import DFlashTrainer, save_dflash, train_dflash

    plain = specdec.assemble(target, None, policy)
    seqs = [list(p) + plain.generate(list(p), max_tokens=40).tokens for p in prompts]
    module, _ = load_dflash(folder, target)
    losses: list[float] = []
    result = train_dflash(
        target,
        DFlashTrainer(module, target, gamma=4.0, anchors=24),
        seqs,
        steps=steps,
        lr=3e-3,
        batch_size=1,
        warmup=6,
        held_out=seqs[-1:],
        progress=lambda step, total, loss, held: losses.append(loss),
        prompt_lengths=[len(p) for p in prompts],  # blocks on the answers only
        held_out_prompt_lengths=[len(prompts[-1])],
    )
    save_dflash(out, module)
    return losses, result
