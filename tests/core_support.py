"""Helpers the core's tests import (a module name of its own: every test folder has a conftest)."""

from __future__ import annotations

import specdec

SEED_PROMPT = [3, 17, 42, 9, 28, 5, 61, 11]


def oracle_policy(model, corruption="none", block=4, **extra):
    """A policy drafting with the kit's oracle drafter."""
    return specdec.Policy(
        name=f"oracle-{corruption}",
        drafters=("oracle",),
        options={"oracle": {"model": model, "corruption": corruption, "block": block}},
        **extra,
    )
