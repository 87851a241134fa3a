"""pytest plugin of the specdec test kit (auto-loaded through the ``pytest11`` entry point).

Fixtures:
    ``specdec_tiny_model``: a factory ``(arch="llama", **kw) -> model`` (see :func:`specdec.testing.make_tiny_model`).
    ``specdec_fresh_host``: a fresh plugin host installed as the process-wide host for the test.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def specdec_tiny_model():
    """Factory for tiny random mlx-lm models (cached per arguments)."""
    from specdec.testing import make_tiny_model

    return make_tiny_model


@pytest.fixture
def specdec_fresh_host():
    """A freshly loaded plugin host, installed for the duration of the test."""
    from specdec.plugins import PluginHost, reset_plugin_host

    host = PluginHost()
    reset_plugin_host(host)
    yield host
    reset_plugin_host(None)
