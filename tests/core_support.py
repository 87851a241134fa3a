"""Helpers the core's tests import (a module name of its own: every test folder has a conftest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

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


class OneAmountRollback:
    """Claims mlx-lm's ``BatchRotatingKVCache`` without ``supports_batch``: a batch whose
    sliding-window layers get it cannot roll its rows back by different amounts (policy
    ``rollback = "one_amount"``; register :class:`OneAmountPlugin`)."""

    name = "one_amount"

    def supports(self, cache):
        from mlx_lm.models.cache import BatchRotatingKVCache

        return type(cache) is BatchRotatingKVCache

    def begin(self, cache):
        return specdec.rollback.BatchRotatingRollback().begin(cache)


class OneAmountPlugin:
    @specdec.hookimpl
    def specdec_register_cache_rollbacks(self, register):
        register("one_amount", OneAmountRollback)


class SoloOnlyDrafter(specdec.BaseDrafter):
    """A drafter without ``supports_batch`` (its sessions propose nothing)."""

    name = "solo_only"

    def session(self, ctx):
        class _Nothing(specdec.BaseDrafterSession):
            def propose(self, history, max_len):
                return None

        return _Nothing()


class SoloOnlyPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("solo_only", SoloOnlyDrafter)


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


#: The end-of-sequence token of :func:`write_json_tokenizer`'s tokenizer.
JSON_EOS = "<|end|>"

_JSON_TEXTS = [
    '{"name":"Alice Johnson","city":"Portland","age":34,"tags":["nurse","hiker"]}',
    '{"title":"Speculative decoding","year":2023,"authors":["Leviathan","Kalman"]}',
    "yes no maybe 0123456789 true false null [] {} , : \" ' abc xyz",
    "The quick brown fox jumps over the lazy dog. Alice lives in Portland.",
]


def write_json_tokenizer(path: Path, vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer (``tokenizer.json``, a Hugging Face fast tokenizer as
    llguidance reads it) with merges learned from a few JSON lines, saved in ``path``
    and loaded with mlx-lm; its EOS is :data:`JSON_EOS`."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[JSON_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_JSON_TEXTS * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": JSON_EOS})
    )
    return load_tokenizer(path)
