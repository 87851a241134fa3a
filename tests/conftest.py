"""Shared fixtures for the core's tests."""

from __future__ import annotations

import pytest
import specdec
from specdec.testing import copy_heavy_prompt, make_tiny_model

SEED_PROMPT = [3, 17, 42, 9, 28, 5, 61, 11]


@pytest.fixture(scope="session")
def models():
    """Tiny models by architecture."""
    return {arch: make_tiny_model(arch) for arch in specdec.testing.ARCHITECTURES}


@pytest.fixture(scope="session")
def copy_prompts(models):
    """A copy-heavy prompt per architecture."""
    return {arch: copy_heavy_prompt(m, SEED_PROMPT, 24) for arch, m in models.items()}


def oracle_policy(model, corruption="none", block=4, **extra):
    """A policy drafting with the kit's oracle drafter."""
    return specdec.Policy(
        name=f"oracle-{corruption}",
        drafters=("oracle",),
        options={"oracle": {"model": model, "corruption": corruption, "block": block}},
        **extra,
    )
