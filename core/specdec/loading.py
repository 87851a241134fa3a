"""Loading target and draft models from paths or Hub ids, with clear errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ModelLoadError


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", ".", "~")) or s.count("/") != 1 or os.sep == "\\" and "\\" in s


def check_model_path(spec: str | os.PathLike, *, what: str = "model") -> None:
    """Raise before any work when ``spec`` is meant as a local path and is not a model folder.

    Raises:
        ModelLoadError: the path does not exist or has no ``config.json``.
    """
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.exists():
        if p.is_dir() and not (p / "config.json").exists():
            raise ModelLoadError(
                f"{what} folder {s!r} has no config.json: expected an mlx-lm model folder "
                "(config.json, *.safetensors, tokenizer files) or a Hugging Face Hub id"
            )
        if not p.is_dir():
            raise ModelLoadError(
                f"{what} path {s!r} is a file: expected an mlx-lm model folder or a Hub id"
            )
        return
    if _looks_like_path(s):
        raise ModelLoadError(
            f"{what} path {s!r} does not exist: expected an mlx-lm model folder "
            "(config.json, *.safetensors, tokenizer files) or a Hugging Face Hub id like 'org/name'"
        )


def load_model(spec: str | os.PathLike, *, what: str = "model") -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` with mlx-lm from a folder or Hub id.

    Raises:
        ModelLoadError: naming the path and the underlying problem.
    """
    check_model_path(spec, what=what)
    from mlx_lm import load

    s = os.fspath(spec)
    try:
        return load(str(Path(s).expanduser()) if Path(s).expanduser().exists() else s)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load {what} {s!r}: {type(exc).__name__}: {exc}. Point it at a local mlx-lm "
            "model folder (no network access is needed for local folders)"
        ) from exc
