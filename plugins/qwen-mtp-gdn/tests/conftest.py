"""Shared fixtures: tiny hybrid models and copy-heavy prompts (no downloads)."""

from __future__ import annotations

import pytest
from gdn_support import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request):
    """Each pipeline architecture."""
    return request.param
