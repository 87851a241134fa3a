"""nox sessions for specdec.

    nox -s tests        core and every plugin installed editable, all tests
    nox -s plugin       per plugin: core + that plugin built as wheels, clean venv, its tests
    nox -s lint         ruff check + ruff format --check

On Linux, mlx needs its CPU backend (``mlx[cpu]``, the ``mlx-cpu`` wheel);
every session that runs mlx installs the core with the ``cpu`` extra there.
Each session uses a fresh virtual environment (``venv``, with the interpreter
that runs nox) and pip, so pip's own configuration and cache on the machine apply.
Extra arguments after ``--`` go to pytest: ``nox -s tests -- -k cli -x``.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parent.resolve()

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["tests", "plugin", "lint"]

LINT_PATHS = ["core", "tests", "plugins", "docs", "noxfile.py"]
#: The core's extras: ``cpu`` pulls mlx's CPU backend (its marker limits it to Linux),
#: ``test`` the test tools.
CORE_EXTRAS = "cpu,test"
TEST_REQUIREMENTS = ["pytest>=8", "scipy>=1.10"]


def _packages(parent: str) -> list[Path]:
    """Folders directly under ``parent`` that are Python distributions (have a pyproject.toml)."""
    base = ROOT / parent
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if (p / "pyproject.toml").is_file())


def _plugin_dirs() -> list[Path]:
    return _packages("plugins") + _packages("docs/examples")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _test_dirs() -> list[str]:
    dirs = ["tests"] if (ROOT / "tests").is_dir() else []
    dirs += [_rel(p / "tests") for p in _plugin_dirs() if (p / "tests").is_dir()]
    return dirs


def _pytest(session: nox.Session, *paths: str) -> None:
    """Run pytest; exit status 5 ("no tests collected") is a failure too."""
    if not paths:
        session.error("no test folders found")
    session.run("pytest", *paths, *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """The core and every plugin (plugins/*, docs/examples/*) installed editable; all tests."""
    args = ["-e", f".[{CORE_EXTRAS}]"]
    for p in _plugin_dirs():
        args += ["-e", _rel(p)]
    session.install(*args, *TEST_REQUIREMENTS)
    session.run("specdec", "plugins", "--all")
    _pytest(session, *_test_dirs())


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pyproject(folder: Path) -> dict:
    with open(folder / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _local_distributions() -> dict[str, Path]:
    """Normalized distribution name -> folder, for the core and every plugin folder."""
    out = {}
    for folder in [ROOT, *_plugin_dirs()]:
        name = _pyproject(folder).get("project", {}).get("name")
        if name:
            out[_norm(name)] = folder
    return out


def _direct_local_requirements(folder: Path, extras: tuple[str, ...]) -> list[Path]:
    """Folders of this repository's distributions that ``folder`` names (with ``extras``)."""
    project = _pyproject(folder).get("project", {})
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    local = _local_distributions()
    found = []
    for req in reqs:
        m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        target = local.get(_norm(m.group(1))) if m else None
        if target is not None and target not in found:
            found.append(target)
    return found


def _local_requirements(folder: Path, extras: tuple[str, ...] = ("test",)) -> list[Path]:
    """Folders of this repository's distributions that ``folder`` requires (with ``extras``),
    and what those require in turn (their dependencies, not their extras)."""
    found: list[Path] = []
    queue = _direct_local_requirements(folder, extras)
    while queue:
        target = queue.pop(0)
        if target in (ROOT, folder) or target in found:
            continue
        found.append(target)
        queue += _direct_local_requirements(target, ())
    return found


@nox.session
@nox.parametrize("name", [_rel(p) for p in _plugin_dirs()], ids=[p.name for p in _plugin_dirs()])
def plugin(session: nox.Session, name: str) -> None:
    """One plugin as a third party sees it: core and plugin built as wheels, its tests alone.

    Other distributions of this repository that the plugin names in its
    dependencies or its ``test`` extra are built as wheels too and found
    through ``--find-links``; nothing else from the source tree is installed.
    """
    folder = ROOT / name
    tests_dir = folder / "tests"
    if not tests_dir.is_dir():
        session.error(f"{name} has no tests/ folder")
    wheels = Path(session.create_tmp()) / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    siblings = _local_requirements(folder)
    session.install("pip>=23", "wheel")
    session.run(
        "python",
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--wheel-dir",
        str(wheels),
        str(ROOT),
        str(folder),
        *[str(p) for p in siblings],
    )
    plugin_name = _norm(_pyproject(folder)["project"]["name"]).replace("-", "_")
    core_whl = list(wheels.glob("specdec_core-*.whl"))
    plugin_whl = [
        w
        for w in wheels.glob("*.whl")
        if _norm(w.name.split("-")[0]).replace("-", "_") == plugin_name
    ]
    if len(core_whl) != 1 or len(plugin_whl) != 1:
        session.error(
            f"expected one core and one plugin wheel in {sorted(w.name for w in wheels.iterdir())}"
        )
    test_extra = (
        "[test]" if "test" in _pyproject(folder)["project"].get("optional-dependencies", {}) else ""
    )
    session.install(
        "--find-links",
        str(wheels),
        f"{core_whl[0]}[cpu]",
        f"{plugin_whl[0]}{test_extra}",
        *TEST_REQUIREMENTS,
    )
    session.run("specdec", "plugins")
    # run from the plugin's folder so its own pytest configuration applies and
    # the core's source tree is not importable (only the installed wheels are)
    session.chdir(folder)
    _pytest(session, "tests")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.install("ruff")
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
