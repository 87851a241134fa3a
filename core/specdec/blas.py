"""Use a fast BLAS for MLX on Linux CPUs.

The Linux CPU wheel of MLX (``mlx-cpu``) links the *reference* BLAS it bundles
(``mlx_cpu.libs/libblas-*.so``): a 1024x1024 float32 matmul runs at a few
GFLOP/s, and a forward over k tokens then costs k forwards over one token, so
speculative decoding cannot save time. When an optimized BLAS with the same
C interface is installed (Debian/Ubuntu: ``apt-get install libopenblas0-pthread``),
loading it into the process's *global* symbol scope before ``mlx.core`` is
imported makes ``libmlx.so`` bind ``cblas_sgemm`` and friends to it: the
dynamic linker searches the global scope before a library's own dependencies.
Measured on a 2-core x86-64: about 4-8 GFLOP/s before, 60-110 after, with the
same results (to float32 rounding).

:func:`ensure_fast_blas` does this; ``import specdec`` calls it before anything
imports mlx. It must run before ``mlx.core`` is first imported: once libmlx has
been loaded its symbol scope is fixed, and loading a BLAS later has no effect
(:func:`ensure_fast_blas` then reports why). The ``specdec`` command falls back
to re-executing itself with ``LD_PRELOAD`` in that case
(:func:`reexec_with_fast_blas`).

Environment:
    ``SPECDEC_NO_FAST_BLAS=1``: do nothing (keep whatever BLAS mlx links).
    ``SPECDEC_BLAS_LIBRARY=/path/libblas.so``: the library to load instead of
    searching the usual places. It must export ``cblas_sgemm``.

This module imports neither mlx nor numpy at import time.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig
import time
from typing import Any

import attrs

ENV_DISABLE = "SPECDEC_NO_FAST_BLAS"
ENV_LIBRARY = "SPECDEC_BLAS_LIBRARY"
#: Set in the environment of a process that :func:`reexec_with_fast_blas` started.
ENV_REEXEC_GUARD = "SPECDEC_FAST_BLAS_REEXEC"
_ENV_ORIG_PRELOAD = "SPECDEC_ORIG_LD_PRELOAD"

#: The symbol whose provider decides which BLAS mlx's matmul runs on.
PROBE_SYMBOL = "cblas_sgemm"

#: Library file names, per directory under ``/usr/lib/<multiarch>/``, that
#: provide an optimized BLAS with the CBLAS interface, best first.
_DEBIAN_VARIANTS = (
    "openblas-pthread/libblas.so.3",
    "openblas-openmp/libblas.so.3",
    "openblas-serial/libblas.so.3",
    "blis-pthread/libblas.so.3",
    "blis-openmp/libblas.so.3",
    "blis-serial/libblas.so.3",
)
_OTHER_LOCATIONS = (
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
#: Path fragments that mark a BLAS as the reference implementation.
_REFERENCE_MARKERS = ("mlx_cpu.libs/libblas", "/blas/libblas.so")
_FAST_MARKERS = ("openblas", "blis", "mkl", "accelerate", "atlas")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() not in ("", "0", "false", "no", "off")


def fast_blas_disabled() -> bool:
    """True when ``SPECDEC_NO_FAST_BLAS`` is set to a true value."""
    return _truthy(os.environ.get(ENV_DISABLE))


@attrs.frozen
class BlasStatus:
    """What :func:`ensure_fast_blas` did.

    Attributes:
        loaded: a fast BLAS provides ``cblas_sgemm`` to the process (loaded now or before).
        library: the path of that library, or of the one that was tried.
        action: ``"loaded"`` (this call loaded it), ``"present"`` (already there,
            e.g. through ``LD_PRELOAD``), ``"disabled"``, ``"unsupported"`` (not Linux),
            ``"not_found"`` (no fast BLAS installed), ``"too_late"`` (mlx.core was
            already imported) or ``"failed"`` (the library could not be loaded).
        reason: one human-readable sentence.
    """

    loaded: bool
    library: str | None
    action: str
    reason: str

    def to_dict(self) -> dict:
        return attrs.asdict(self)


_status: BlasStatus | None = None


def _multiarch() -> str | None:
    triplet = sysconfig.get_config_var("MULTIARCH")
    if triplet:
        return str(triplet)
    machine = os.uname().machine
    return {
        "x86_64": "x86_64-linux-gnu",
        "aarch64": "aarch64-linux-gnu",
        "ppc64le": "powerpc64le-linux-gnu",
        "s390x": "s390x-linux-gnu",
    }.get(machine)


def fast_blas_candidates() -> list[str]:
    """Paths that would provide a fast CBLAS on this machine, best first (existing ones only).

    ``SPECDEC_BLAS_LIBRARY`` when set is the only candidate.
    """
    explicit = os.environ.get(ENV_LIBRARY)
    if explicit:
        return [explicit] if os.path.exists(explicit) else []
    if not sys.platform.startswith("linux"):
        return []
    dirs: list[str] = []
    triplet = _multiarch()
    if triplet:
        dirs.append(f"/usr/lib/{triplet}")
    dirs += sorted(d for d in glob.glob("/usr/lib/*-linux-gnu*") if d not in dirs)
    found: list[str] = []
    for variant in _DEBIAN_VARIANTS:
        for d in dirs:
            p = os.path.join(d, variant)
            if os.path.exists(p) and p not in found:
                found.append(p)
    for p in _OTHER_LOCATIONS:
        if os.path.exists(p) and p not in found:
            found.append(p)
    return found


def find_fast_blas() -> str | None:
    """The best fast BLAS installed here, or None."""
    cands = fast_blas_candidates()
    return cands[0] if cands else None


# -- introspection -----------------------------------------------------------


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def _libc() -> Any | None:
    try:
        lib = ctypes.CDLL(None)
        lib.dlsym.restype = ctypes.c_void_p
        lib.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.dladdr.restype = ctypes.c_int
        lib.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        return lib
    except (OSError, AttributeError):  # pragma: no cover - not glibc-like
        return None


def _provider(handle: int | None, symbol: str = PROBE_SYMBOL) -> str | None:
    """The file that provides ``symbol`` as seen from ``handle`` (None: the global scope)."""
    lib = _libc()
    if lib is None:
        return None
    addr = lib.dlsym(handle, symbol.encode())
    if not addr:
        return None
    info = _DlInfo()
    if not lib.dladdr(addr, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.path.realpath(info.dli_fname.decode(errors="replace"))


def global_blas_provider() -> str | None:
    """The library that provides ``cblas_sgemm`` in the process's global scope, if any.

    Libraries that are loaded afterwards (as libmlx is) bind to this one first.
    """
    if not sys.platform.startswith("linux"):
        return None
    return _provider(None)


def _mlx_library_path() -> str | None:
    for path in _mapped_files():
        if os.path.basename(path).startswith("libmlx"):
            return path
    return None


def active_blas_library() -> str | None:
    """The BLAS library whose ``cblas_sgemm`` mlx's CPU matmul calls (Linux), or None if unknown.

    The global scope wins when it has the symbol; otherwise libmlx uses its own
    dependency (the bundled reference BLAS for ``mlx-cpu``).
    """
    g = global_blas_provider()
    if g:
        return g
    mlx_lib = _mlx_library_path()
    if mlx_lib is None:
        return None
    try:
        handle = ctypes.CDLL(mlx_lib, mode=getattr(os, "RTLD_NOLOAD", 4) | os.RTLD_LOCAL)
    except OSError:
        return None
    return _provider(handle._handle)


def _mapped_files() -> list[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    out: list[str] = []
    seen: set[str] = set()
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if path.startswith("/") and path not in seen:
            seen.add(path)
            out.append(path)
    return out


def loaded_blas_libraries() -> list[str]:
    """Every BLAS-like shared library mapped into this process, from ``/proc/self/maps``.

    Mapped is not the same as used: the bundled reference BLAS stays mapped as a
    dependency of libmlx even when a fast one wins; see :func:`active_blas_library`.
    """
    keys = ("blas", "blis", "mkl_rt", "libmkl")
    return [p for p in _mapped_files() if any(k in os.path.basename(p).lower() for k in keys)]


def is_reference_blas(path: str | None) -> bool:
    """True for the reference BLAS that the mlx-cpu wheel bundles (slow)."""
    if not path:
        return False
    p = path.replace(os.sep, "/")
    return any(m in p for m in _REFERENCE_MARKERS)


def is_fast_blas(path: str | None) -> bool:
    """True for a library path that names an optimized BLAS (OpenBLAS, BLIS, MKL, ...)."""
    if not path:
        return False
    low = os.path.realpath(path).lower() + " " + path.lower()
    return any(m in low for m in _FAST_MARKERS) and not is_reference_blas(path)


# -- the switch ----------------------------------------------------------------


def _restore_preload_after_reexec() -> None:
    """In a process started by :func:`reexec_with_fast_blas`: undo its LD_PRELOAD for children."""
    if os.environ.get(ENV_REEXEC_GUARD) != "1" or _ENV_ORIG_PRELOAD not in os.environ:
        return
    orig = os.environ.pop(_ENV_ORIG_PRELOAD)
    if orig:
        os.environ["LD_PRELOAD"] = orig
    else:
        os.environ.pop("LD_PRELOAD", None)


def ensure_fast_blas(*, force: bool = False) -> BlasStatus:
    """Load a fast BLAS into the global symbol scope so that mlx uses it.

    Call before the first ``import mlx.core`` (``import specdec`` does). Idempotent:
    the first result is cached; ``force=True`` tries again.

    Returns:
        a :class:`BlasStatus`. Never raises.
    """
    global _status
    if _status is not None and not force:
        return _status
    _restore_preload_after_reexec()
    _status = _ensure()
    return _status


def _ensure() -> BlasStatus:
    if fast_blas_disabled():
        return BlasStatus(False, None, "disabled", f"{ENV_DISABLE} is set")
    if not sys.platform.startswith("linux"):
        return BlasStatus(
            False, None, "unsupported", f"not needed on {sys.platform} (mlx uses its own BLAS)"
        )
    current = global_blas_provider()
    if current and not is_reference_blas(current):
        return BlasStatus(True, current, "present", f"{current} already provides {PROBE_SYMBOL}")
    lib = find_fast_blas()
    if lib is None:
        hint = (
            f"{os.environ[ENV_LIBRARY]} does not exist"
            if os.environ.get(ENV_LIBRARY)
            else "no fast BLAS installed (Debian/Ubuntu: apt-get install libopenblas0-pthread)"
        )
        return BlasStatus(False, None, "not_found", hint)
    if "mlx.core" in sys.modules:
        return BlasStatus(
            False,
            lib,
            "too_late",
            "mlx.core was imported before specdec; import specdec first, or run with "
            f"LD_PRELOAD={lib}",
        )
    try:
        handle = ctypes.CDLL(lib, mode=os.RTLD_GLOBAL)
    except OSError as exc:
        return BlasStatus(False, lib, "failed", f"cannot load {lib}: {exc}")
    if not hasattr(handle, PROBE_SYMBOL):
        return BlasStatus(False, lib, "failed", f"{lib} does not export {PROBE_SYMBOL}")
    return BlasStatus(True, lib, "loaded", f"loaded {lib} before mlx")


def fast_blas_status() -> BlasStatus | None:
    """The result of the last :func:`ensure_fast_blas` call, or None if it never ran."""
    return _status


def reexec_with_fast_blas(argv: list[str] | None = None) -> None:
    """Re-execute this Python process with ``LD_PRELOAD`` set to a fast BLAS, if that helps.

    For command-line entry points only: it replaces the running process. Does
    nothing when fast BLAS is disabled, not on Linux, already active, not
    installed, when this process was itself re-executed (guard variable), or
    when mlx has not been imported yet (then :func:`ensure_fast_blas` suffices).

    Args:
        argv: the command line to run again (default: ``sys.orig_argv`` minus the
            interpreter, i.e. the same script, ``-m`` module or ``-c`` code and arguments).
    """
    if fast_blas_disabled() or not sys.platform.startswith("linux"):
        return
    if os.environ.get(ENV_REEXEC_GUARD) == "1" or "mlx.core" not in sys.modules:
        # re-executed already (ensure restores LD_PRELOAD and records the result),
        # or still early enough to load the library in-process
        ensure_fast_blas()
        return
    active = active_blas_library()
    if active and not is_reference_blas(active):
        return
    lib = find_fast_blas()
    if lib is None:
        return
    if argv is None:
        orig = getattr(sys, "orig_argv", None)
        if not orig:
            return
        argv = list(orig[1:])
    env = dict(os.environ)
    old = env.get("LD_PRELOAD", "")
    env[_ENV_ORIG_PRELOAD] = old
    env["LD_PRELOAD"] = f"{lib}:{old}" if old else lib
    env[ENV_REEXEC_GUARD] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    try:
        os.execve(sys.executable, [sys.executable, *argv], env)
    except OSError:  # pragma: no cover - exec failed: carry on slowly
        return


# -- measurement ----------------------------------------------------------------


def measure_matmul_gflops(
    n: int = 1024, *, repeats: int | None = None, min_seconds: float = 0.5, device: str = "cpu"
) -> float:
    """GFLOP/s of an ``n x n`` float32 matmul with mlx (on the CPU by default).

    Runs one warm-up, then ``repeats`` timed matmuls (default: as many as fit
    in about ``min_seconds``, at least 3) and reports the mean.
    """
    import mlx.core as mx

    dev = mx.cpu if device == "cpu" else mx.default_device()
    with mx.stream(dev):
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a, b)
        t0 = time.perf_counter()
        mx.eval(a @ b)
        first = max(time.perf_counter() - t0, 1e-6)
        if repeats is None:
            repeats = max(3, min(50, int(min_seconds / first)))
        t0 = time.perf_counter()
        for _ in range(repeats):
            mx.eval(a @ b)
        dt = (time.perf_counter() - t0) / repeats
    return 2.0 * n**3 / dt / 1e9


def matmul_max_error(n: int = 256) -> float:
    """Largest absolute difference between mlx's float32 CPU matmul and numpy's float64 one.

    A correct BLAS stays around 1e-5 for ``n=256`` (entries ~ N(0, n)).
    """
    import mlx.core as mx
    import numpy as np

    with mx.stream(mx.cpu):
        a = mx.random.normal((n, n), key=mx.random.key(2))
        b = mx.random.normal((n, n), key=mx.random.key(3))
        c = a @ b
        mx.eval(c)
    ref = np.asarray(a, dtype=np.float64) @ np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(np.asarray(c, dtype=np.float64) - ref)))


def blas_report(*, measure: bool = True) -> dict:
    """A JSON-able summary for ``specdec doctor``: what is mapped, what is used, how fast.

    Imports mlx (so that what it maps is seen).
    """
    import mlx.core  # noqa: F401

    st = fast_blas_status() or ensure_fast_blas()
    active = active_blas_library()
    report: dict[str, Any] = {
        "active": active,
        "active_is_reference": is_reference_blas(active),
        "loaded_libraries": loaded_blas_libraries(),
        "fast_blas_candidates": fast_blas_candidates(),
        "fast_blas_disabled": fast_blas_disabled(),
        "ensure_fast_blas": st.to_dict() if st is not None else None,
    }
    if measure:
        report["matmul_gflops"] = round(measure_matmul_gflops(), 2)
        report["matmul_max_abs_error"] = matmul_max_error()
    return report
