"""``specdec.loading``: random weights from a config-only folder, the byte tokenizer, errors."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
import specdec
from core_support import tiny_config
from specdec.loading import ByteTokenizer, check_model_path, load_model


def config_folder(path: Path, **overrides) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(tiny_config(**overrides)))
    return path


def test_config_only_folder_needs_random_weights(tmp_path):
    folder = config_folder(tmp_path / "m")
    with pytest.raises(specdec.ModelLoadError, match="no weights.*--random-weights"):
        load_model(folder)


def test_random_weights_are_seeded_and_get_the_byte_tokenizer(tmp_path):
    folder = config_folder(tmp_path / "m")
    m1, tok = load_model(folder, random_weights=True, seed=3)
    m2, _ = load_model(folder, random_weights=True, seed=3)
    m3, _ = load_model(folder, random_weights=True, seed=4)
    assert isinstance(tok, ByteTokenizer)
    w1, w2, w3 = (m.model.embed_tokens.weight for m in (m1, m2, m3))
    assert mx.array_equal(w1, w2).item() and not mx.array_equal(w1, w3).item()
    # the model runs, and speculation on it changes no token
    ids = tok.encode("abc abc abc abc abc")
    plain = specdec.assemble(m1, tok, "none").generate(ids, max_tokens=12)
    spec = specdec.assemble(m1, tok, "ngram").generate(ids, max_tokens=12)
    assert spec.tokens == plain.tokens and len(plain.tokens) == 12


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "héllo → wörld\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 shows as U+FFFD, no error
    assert tok.get_vocab()["<0x41>"] == 65 and len(tok.get_vocab()) == 256
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_random_weights_refuse_a_small_vocabulary_without_tokenizer(tmp_path):
    folder = config_folder(tmp_path / "m", vocab_size=64)
    with pytest.raises(specdec.ModelLoadError, match="vocab_size 64.*needs vocab_size >= 256"):
        load_model(folder, random_weights=True)


def test_random_weights_refuse_a_folder_with_weights(tmp_path):
    folder = config_folder(tmp_path / "m")
    mx.save_safetensors(str(folder / "model.safetensors"), {"x": mx.zeros((1,))})
    with pytest.raises(specdec.ModelLoadError, match=r"has weights \(\*.safetensors\)"):
        check_model_path(folder, random_weights=True)


def test_random_weights_need_a_local_folder(tmp_path):
    with pytest.raises(specdec.ModelLoadError, match="need a local folder"):
        load_model("org/name", random_weights=True)


def test_random_weights_with_a_bad_config_name_the_folder(tmp_path):
    folder = config_folder(tmp_path / "m", model_type="no_such_arch")
    with pytest.raises(specdec.ModelLoadError, match="could not build model .* random weights"):
        load_model(folder, random_weights=True)
