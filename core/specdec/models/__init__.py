"""Model loading: the GGUF → mlx-lm converter and the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from .default import DEFAULT_MODEL_NAME, default_model_path
from .gguf import GGUFError, convert_gguf

__all__ = ["DEFAULT_MODEL_NAME", "GGUFError", "convert_gguf", "default_model_path"]
