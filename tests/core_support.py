"""Helpers the core's tests import (a module name of its own: every test folder has a conftest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import specdec
from specdec.testing import tiny_model_args

SEED_PROMPT = [3, 17, 42, 9, 28, 5, 61, 11]


def oracle_policy(model, corruption="none", block=4, **extra):
    """A policy drafting with the kit's oracle drafter."""
    return specdec.Policy(
        name=f"oracle-{corruption}",
        drafters=("oracle",),
        options={"oracle": {"model": model, "corruption": corruption, "block": block}},
        **extra,
    )


def tiny_config(**overrides) -> dict:
    """The kit's tiny llama as a ``config.json`` dict, vocabulary 256 (the byte tokenizer's)."""
    return {**dataclasses.asdict(tiny_model_args("llama", vocab_size=256)), **overrides}


def write_random_llama(path: Path, config: dict, *, seed: int = 0) -> None:
    """Write ``config.json`` and random weights (normal, std 0.5) of a llama ``config``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.random.seed(seed)
    model.update(tree_map(lambda p: 0.5 * mx.random.normal(p.shape), model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(config))


def make_tiny_qwen2(seed: int = 1, vocab_size: int = 256):
    """A tiny random qwen2 (the kit's tiny qwen3 shape; mlx-lm gives qwen2 both a
    tensor-parallel ``shard`` and a ``pipeline``), its output head sharpened as the
    kit's tiny models are."""
    import mlx.core as mx
    from mlx_lm.models import qwen2

    cfg = dataclasses.asdict(tiny_model_args("qwen3", vocab_size=vocab_size))
    mx.random.seed(seed)
    model = qwen2.Model(qwen2.ModelArgs.from_dict({**cfg, "model_type": "qwen2"}))
    model.lm_head.weight = model.lm_head.weight * 8.0
    mx.eval(model.parameters())
    model.eval()
    return model
