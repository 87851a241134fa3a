"""specdec.blas: a fast BLAS replaces mlx-cpu's reference BLAS on Linux, results unchanged.

The switch must happen before ``mlx.core`` is imported, so most checks run in a
fresh interpreter (``subprocess``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from specdec import blas

LINUX = sys.platform.startswith("linux")
FAST = blas.find_fast_blas() if LINUX else None
# CI installs OpenBLAS (.ci/run): there a missing fast BLAS is a failure, not a skip.
needs_fast_blas = pytest.mark.skipif(
    FAST is None and not os.environ.get("CI"),
    reason="no fast BLAS installed here (Debian/Ubuntu: apt-get install libopenblas0-pthread)",
)


def _blas_py() -> str:
    spec = importlib.util.find_spec("specdec")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "blas.py")


def _clean_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            blas.ENV_DISABLE,
            blas.ENV_LIBRARY,
            blas.ENV_REEXEC_GUARD,
            "SPECDEC_ORIG_LD_PRELOAD",
            "LD_PRELOAD",
        )
    }
    env.update(extra)
    return env


def _run(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=_clean_env(**env),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The module on its own, loaded from its file: no specdec/__init__ (which imports mlx) runs first.
STANDALONE = f"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("_sd_blas", {_blas_py()!r})
b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)
"""

REPORT = """
st = b.ensure_fast_blas()
import mlx.core
print(json.dumps({"status": st.to_dict(), "active": b.active_blas_library(),
                  "mapped": b.loaded_blas_libraries(),
                  "gflops": max(b.measure_matmul_gflops(512, repeats=4) for _ in range(4)),
                  "err": b.matmul_max_error()}))
"""


def test_module_does_not_import_mlx():
    out = _run(STANDALONE + "print(json.dumps({'mlx': 'mlx.core' in sys.modules}))")
    assert out == {"mlx": False}


def test_loaded_blas_libraries_reads_proc_maps():
    libs = blas.loaded_blas_libraries()
    assert isinstance(libs, list)
    for p in libs:
        assert os.path.isabs(p) and os.path.exists(p)
    if LINUX:
        assert libs, "mlx is imported in this process, so some BLAS must be mapped"
        assert blas.active_blas_library() in libs or blas.active_blas_library() is None


def test_measure_and_error():
    g = blas.measure_matmul_gflops(256, repeats=3)
    assert g > 0
    assert blas.matmul_max_error(128) < 1e-3


def test_status_shape():
    st = blas.ensure_fast_blas()
    assert st.action in {
        "loaded",
        "present",
        "disabled",
        "unsupported",
        "not_found",
        "too_late",
        "failed",
    }
    assert set(st.to_dict()) == {"loaded", "library", "action", "reason"}
    assert st.reason


@needs_fast_blas
def test_standalone_switch_uses_fast_blas_and_results_are_unchanged():
    fast = _run(STANDALONE + REPORT)
    slow = _run(STANDALONE + REPORT, SPECDEC_NO_FAST_BLAS="1")

    assert fast["status"]["action"] == "loaded", fast
    assert fast["status"]["loaded"] is True
    assert blas.is_fast_blas(fast["active"]), fast["active"]
    assert any("blas" in os.path.basename(p).lower() for p in fast["mapped"])

    assert slow["status"]["action"] == "disabled"
    assert not blas.is_fast_blas(slow["active"]) or not blas.is_reference_blas(slow["active"])

    # same numbers to float32 rounding, both ways
    assert fast["err"] < 1e-3 and slow["err"] < 1e-3
    # the reason for all this: fast BLAS is much faster than mlx-cpu's reference BLAS
    # (about 8x on 2 idle cores; best of 4 runs each, so a busy machine does not flake)
    if blas.is_reference_blas(slow["active"]):
        assert fast["gflops"] > 1.5 * slow["gflops"], (fast["gflops"], slow["gflops"])


@needs_fast_blas
def test_import_specdec_switches_to_fast_blas():
    out = _run(
        """
        import json, sys
        import specdec
        from specdec import blas
        import mlx.core
        print(json.dumps({"status": blas.fast_blas_status() and blas.fast_blas_status().to_dict(),
                          "active": blas.active_blas_library()}))
        """
    )
    assert out["status"]["action"] in ("loaded", "present"), (
        "specdec/__init__.py must import specdec.blas before anything imports mlx",
        out,
    )
    assert blas.is_fast_blas(out["active"]), out


@needs_fast_blas
def test_too_late_after_mlx_import():
    out = _run(
        "import mlx.core\n"
        + STANDALONE
        + "print(json.dumps(b.ensure_fast_blas().to_dict() | {'active': b.active_blas_library()}))"
    )
    if blas.is_reference_blas(out["active"]):
        assert out["action"] == "too_late"
        assert "LD_PRELOAD=" in out["reason"]


@needs_fast_blas
def test_import_specdec_after_mlx_warns_when_too_late():
    code = (
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "import mlx.core\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import specdec\n"
        "st = specdec.blas.ensure_fast_blas()\n"
        "print(json.dumps({'action': st.action, 'active': specdec.blas.active_blas_library(),\n"
        "                  'warnings': [str(x.message) for x in w]}))\n"
    )
    out = _run(code)
    if blas.is_reference_blas(out["active"]):
        assert out["action"] == "too_late"
        (msg,) = [m for m in out["warnings"] if "reference BLAS" in m]
        assert "import specdec before mlx" in msg and "LD_PRELOAD=" in msg
    else:  # mlx found a fast BLAS by itself: nothing to warn about
        assert not [m for m in out["warnings"] if "reference BLAS" in m]
    fine = _run(
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import specdec\n"
        "print(json.dumps({'warnings': [str(x.message) for x in w]}))\n"
    )
    assert not [m for m in fine["warnings"] if "reference BLAS" in m]


@needs_fast_blas
def test_reexec_with_ld_preload():
    out = _run(
        "import mlx.core, os\n"
        + STANDALONE
        + """
b.reexec_with_fast_blas()
print(json.dumps({"active": b.active_blas_library(),
                  "guard": os.environ.get(b.ENV_REEXEC_GUARD),
                  "ld_preload": os.environ.get("LD_PRELOAD"),
                  "status": b.fast_blas_status().to_dict()}))
"""
    )
    assert blas.is_fast_blas(out["active"]), out
    assert out["status"]["loaded"] is True
    if out["guard"] == "1":  # it did re-execute: LD_PRELOAD is not passed on to children
        assert out["ld_preload"] is None


def test_disabled_env(monkeypatch):
    monkeypatch.setattr(blas, "_status", blas.fast_blas_status())  # restored afterwards
    monkeypatch.setenv(blas.ENV_DISABLE, "1")
    assert blas.fast_blas_disabled()
    st = blas.ensure_fast_blas(force=True)
    assert st.action == "disabled" and not st.loaded
    monkeypatch.setenv(blas.ENV_DISABLE, "0")
    assert not blas.fast_blas_disabled()


def test_explicit_library_env(monkeypatch, tmp_path):
    monkeypatch.setenv(blas.ENV_LIBRARY, str(tmp_path / "libnope.so"))
    assert blas.fast_blas_candidates() == []
    assert blas.find_fast_blas() is None


def test_reference_and_fast_names():
    assert blas.is_reference_blas("/x/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0")
    assert not blas.is_fast_blas("/x/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0")
    assert blas.is_fast_blas("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3")
    assert not blas.is_fast_blas(None)
