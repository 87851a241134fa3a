"""Where specdec keeps what it computes once and reuses (one rule for the core and plugins)."""

from __future__ import annotations

import os
from pathlib import Path

#: Overrides the cache folder.
CACHE_ENV = "SPECDEC_CACHE_DIR"


def cache_dir() -> Path:
    """specdec's cache folder: ``$SPECDEC_CACHE_DIR``, ``$XDG_CACHE_HOME/specdec`` or
    ``~/.cache/specdec`` (not created here).

    The core keeps the default model (``models/``) and verify cost curves
    (``verify-cost/``) there; plugins keep their own files in a folder named after
    their distribution.
    """
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdec"
    return Path.home() / ".cache" / "specdec"
