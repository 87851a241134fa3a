"""specdec.checkpoints: the target identity a trained head records, and the check a
drafter runs against it (no training code needed)."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
from specdec.checkpoints import TARGET_FIELD, identity_mismatch, target_identity
from specdec.testing import make_tiny_model


def test_a_target_identity_survives_a_cast_but_not_another_model():
    model = make_tiny_model("llama")
    me = target_identity(model)
    assert identity_mismatch(me, model) == {}
    other = make_tiny_model("llama", seed=5)
    assert set(identity_mismatch(me, other)) == {
        "embed_sha256",
        "embed_sha256_bf16",
        "embed_sha256_f16",
    }
    cast = make_tiny_model("llama")
    w = cast.model.embed_tokens.weight
    try:
        cast.model.embed_tokens.weight = w.astype(mx.bfloat16)
        assert identity_mismatch(me, cast) == {}
    finally:
        cast.model.embed_tokens.weight = w


def test_the_field_name_is_what_trained_heads_carry():
    assert TARGET_FIELD == "specdec_target"


def test_the_identity_check_imports_no_training_code():
    code = (
        "import sys, specdec, specdec.checkpoints; "
        "print(sorted(m for m in sys.modules if m.startswith(('specdec.training', 'specdec_train'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
