"""Loading target and draft models from paths or Hub ids, with clear errors.

A model folder that has a ``config.json`` and no weights can be built with
random weights (``load_model(folder, random_weights=True)``, ``specdec bench
--random-weights``): enough to measure what verification, rollback and the
loop cost on an architecture, and to check that speculation changes no token.
Without tokenizer files such a model gets a :class:`ByteTokenizer`.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

#: Files that hold a tokenizer in an mlx-lm / Hugging Face model folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


class ByteTokenizer:
    """Token ``i`` is the byte ``i`` (0-255) of the UTF-8 text; no special tokens.

    The tokenizer of a model built with random weights from a folder that has no
    tokenizer files. Its model needs ``vocab_size >= 256``.
    """

    vocab_size = 256

    def __init__(self) -> None:
        self.eos_token_ids: set[int] = set()
        self.eos_token_id = None
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], **_: Any) -> str:
        """The text of the bytes ``ids`` (invalid UTF-8 shown as U+FFFD)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: Any, **_: Any) -> Any:
        """Always raises: a byte tokenizer has no chat template (encode the text instead)."""
        raise ValueError("the byte tokenizer has no chat template; encode the prompt text")

    def get_vocab(self) -> dict[str, int]:
        """``{"<0x00>": 0, ..., "<0xFF>": 255}`` (what mlx-lm's tokenizer wrapper reads)."""
        return {f"<0x{i:02X}>": i for i in range(self.vocab_size)}


def _weight_files(folder: Path) -> list[str]:
    return sorted(glob.glob(str(folder / "*.safetensors")))


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", ".", "~")) or s.count("/") != 1 or os.sep == "\\" and "\\" in s


def check_model_path(
    spec: str | os.PathLike, *, what: str = "model", random_weights: bool = False
) -> None:
    """Raise before any work when ``spec`` is meant as a local path and is not a model folder.

    Raises:
        ModelLoadError: the path does not exist or has no ``config.json``; a folder
            without weights and ``random_weights`` false; ``random_weights`` for a
            Hub id or a folder that has weights.
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
        has_weights = bool(_weight_files(p))
        if random_weights and has_weights:
            raise ModelLoadError(
                f"{what} folder {s!r} has weights (*.safetensors): random weights are only "
                "built for a folder with a config.json and no weights; drop the random-weights "
                "option to load its weights"
            )
        if not random_weights and not has_weights:
            raise ModelLoadError(
                f"{what} folder {s!r} has a config.json but no weights (*.safetensors): "
                "give a folder with weights, or ask for random weights built from the config "
                "(specdec bench --random-weights; load_model(..., random_weights=True))"
            )
        return
    if random_weights:
        raise ModelLoadError(
            f"{what} {s!r}: random weights need a local folder with a config.json (no such folder)"
        )
    if _looks_like_path(s):
        raise ModelLoadError(
            f"{what} path {s!r} does not exist: expected an mlx-lm model folder "
            "(config.json, *.safetensors, tokenizer files) or a Hugging Face Hub id like 'org/name'"
        )


def default_model_path() -> Path:
    """The folder of the built-in default model (SmolLM2-135M-Instruct, float32), fetched
    and converted on first use: what ``model=None`` loads, for tools that hand the path
    to another program (``specdec bench-serve`` gives it to ``mlx_lm.server``).

    Raises:
        ModelLoadError: it could not be fetched (no network), saying how to point
            ``--model`` at a local folder instead.
    """
    from .models import default_model_path as fetch

    return fetch()


def fast_blas_library() -> str | None:
    """The optimized BLAS library ``import specdec`` bound MLX to in this process (see
    ``specdec info``), or ``None``: what another MLX process (``mlx_lm.server`` in
    ``specdec bench-serve``) should ``LD_PRELOAD`` to run the same matmuls."""
    from .blas import fast_blas_status

    status = fast_blas_status()
    return status.library if status is not None and status.loaded else None


def load_model(
    spec: str | os.PathLike,
    *,
    what: str = "model",
    random_weights: bool = False,
    seed: int = 0,
    lazy: bool = False,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` with mlx-lm from a folder or Hub id.

    Args:
        spec: an mlx-lm model folder or a Hugging Face Hub id.
        what: how errors name the model ("model", "draft model").
        random_weights: build the model from the folder's ``config.json`` with
            mlx-lm's random initialisation (seeded by ``seed``) instead of loading
            weights. Only for a local folder with no ``*.safetensors``; its tokenizer
            files are used when it has them, else a :class:`ByteTokenizer`.
        seed: the initialisation seed with ``random_weights``.
        lazy: leave the weights unevaluated (mlx-lm's ``lazy=True``): a model about to be
            sharded then reads only its shard's slices when evaluated.

    Raises:
        ModelLoadError: naming the path and the underlying problem.
    """
    check_model_path(spec, what=what, random_weights=random_weights)
    s = os.fspath(spec)
    folder = Path(s).expanduser()
    if random_weights:
        model, tokenizer = _random_model(folder, what=what, seed=seed)
        set_model_source(model, folder)
        return model, tokenizer
    from mlx_lm import load

    try:
        model, tokenizer = load(str(folder) if folder.exists() else s, lazy=lazy)
    except Exception as exc:
        raise ModelLoadError(
            f"could not load {what} {s!r}: {type(exc).__name__}: {exc}. Point it at a local mlx-lm "
            "model folder (no network access is needed for local folders)"
        ) from exc
    if folder.is_dir():
        set_model_source(model, folder)
    return model, tokenizer


_SOURCE_ATTR = "_specdec_source"


def set_model_source(model: Any, folder: str | os.PathLike) -> None:
    """Record the folder ``model`` was loaded from (what :func:`model_source` returns)."""
    object.__setattr__(model, _SOURCE_ATTR, Path(folder).resolve())


def model_source(model: Any) -> Path | None:
    """The local folder :func:`specdec.assemble` (or :func:`load_model`) loaded ``model``
    from, or ``None`` (a model object built or loaded elsewhere, or a Hub id). Plugins
    read files the loader does not keep from it (e.g. the MTP weights mlx-lm drops)."""
    d = getattr(model, "__dict__", {})
    v = d.get(_SOURCE_ATTR)
    return v if isinstance(v, Path) else None


def _random_model(folder: Path, *, what: str, seed: int) -> tuple[Any, Any]:
    import mlx.core as mx
    from mlx_lm.utils import load_model as mlx_load_model

    try:
        mx.random.seed(seed)
        # strict=False with no weight files: mlx-lm's own initialisation of every parameter
        model, config = mlx_load_model(folder, strict=False)
    except Exception as exc:
        raise ModelLoadError(
            f"could not build {what} {str(folder)!r} with random weights from its config.json: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if any((folder / f).exists() for f in TOKENIZER_FILES):
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        try:
            tokenizer = load_tokenizer(folder)
        except Exception as exc:
            raise ModelLoadError(
                f"could not load the tokenizer of {what} {str(folder)!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return model, tokenizer
    vocab = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    if not isinstance(vocab, int) or vocab < ByteTokenizer.vocab_size:
        raise ModelLoadError(
            f"{what} folder {str(folder)!r} has no tokenizer files and vocab_size {vocab!r}: "
            f"a model without a tokenizer gets the byte tokenizer, which needs vocab_size >= "
            f"{ByteTokenizer.vocab_size}; add tokenizer files ({', '.join(TOKENIZER_FILES)}) "
            "or raise vocab_size"
        )
    return model, ByteTokenizer()
