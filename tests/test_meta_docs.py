"""Meta-tests that keep the plugin surface and its documentation honest.

- every hook in :mod:`specdec.hookspecs` is documented in ``docs/hooks.md`` with
  its exact signature, and has a ``test_hook_<hook name>`` under ``tests/``;
- every method of every role Protocol in :mod:`specdec.roles` is documented in
  ``docs/hooks.md`` with its signature, and every declared optional member
  (:data:`specdec.roles.OPTIONAL_MEMBERS`) with its default;
- every Policy field and preset is documented in ``docs/policy.md``;
- code included in the docs from tested files (``<!-- include: PATH -->``
  followed by a fenced block) is a verbatim excerpt of that file;
- relative links between the docs resolve.
"""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import attrs
import pytest
import specdec
from specdec import hookspecs, roles
from specdec.policy import Policy
from specdec.presets import PRESETS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TESTS = ROOT / "tests"
EXAMPLE = DOCS / "examples" / "specdec-example-drafter"

HOOKS = sorted(
    name
    for name, fn in vars(hookspecs).items()
    if name.startswith("specdec_") and inspect.isfunction(fn)
)
PROTOCOLS = sorted(
    name
    for name, cls in vars(roles).items()
    if inspect.isclass(cls)
    and cls.__module__ == roles.__name__
    and getattr(cls, "_is_protocol", False)
)

INCLUDE = re.compile(r"<!-- include: (?P<path>\S+) -->\s*\n```[\w-]*\n(?P<code>.*?)\n```", re.S)


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def normalize(text: str) -> str:
    """Collapse formatting so a signature wrapped by ``ruff format`` still matches its one-line form."""
    text = re.sub(r"\s+", " ", text.replace("'", '"'))
    text = re.sub(r"\(\s+", "(", text)
    return re.sub(r",?\s*\)", ")", text)


def format_signature(fn) -> str:
    """``fn``'s signature as written in the source, without quotes around annotations."""
    sig = inspect.signature(fn)
    parts = []
    star_done = False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            text = f"*{p.name}"
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        else:
            text = p.name
        if p.annotation is not p.empty:
            ann = (
                p.annotation
                if isinstance(p.annotation, str)
                else inspect.formatannotation(p.annotation)
            )
            text += f": {ann}"
            if p.default is not p.empty:
                text += f" = {p.default!r}"
        elif p.default is not p.empty:
            text += f"={p.default!r}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        ret = sig.return_annotation
        out += f" -> {ret if isinstance(ret, str) else inspect.formatannotation(ret)}"
    return out


def protocol_methods():
    for cls_name in PROTOCOLS:
        cls = getattr(roles, cls_name)
        for meth, fn in vars(cls).items():
            if inspect.isfunction(fn) and not meth.startswith("_"):
                yield cls_name, meth, fn


def test_there_are_hooks_and_roles():
    assert len(HOOKS) >= 5
    assert {"Drafter", "Verifier", "Acceptor", "CacheRollback", "Governor"} <= set(PROTOCOLS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_exact_signature(hook):
    fn = getattr(hookspecs, hook)
    signature = f"{hook}{inspect.signature(fn)}"
    hooks_md = _read(DOCS / "hooks.md")
    assert f"`{signature}`" in hooks_md or f"\n{signature}\n" in hooks_md, (
        f"docs/hooks.md must document {signature}"
    )
    assert fn.__doc__ and fn.__doc__.strip(), f"{hook} needs a docstring"


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_has_a_test(hook):
    pattern = re.compile(rf"^\s*(async\s+)?def test_hook_{hook}\b", re.M)
    found = [p for p in TESTS.rglob("*.py") if pattern.search(_read(p))]
    assert found, f"no test named test_hook_{hook} under tests/"


@pytest.mark.parametrize(
    "cls_name,meth,fn",
    list(protocol_methods()),
    ids=[f"{c}.{m}" for c, m, _ in protocol_methods()],
)
def test_protocol_method_documented(cls_name, meth, fn):
    signature = f"def {meth}{format_signature(fn)}"
    hooks_md = _read(DOCS / "hooks.md")
    section = hooks_md.split(f"class {cls_name}(", 1)
    assert len(section) == 2, f"docs/hooks.md must show `class {cls_name}(...)`"
    assert normalize(signature) in normalize(section[1].split("\nclass ", 1)[0]), (
        f"docs/hooks.md must document {cls_name}.{signature} under class {cls_name}"
    )


def test_register_callback_documented():
    hooks_md = _read(DOCS / "hooks.md")
    assert (
        'register(name, factory, *, description="", needs=None, provides=None, '
        "supports_batch=None)" in hooks_md
    )
    for keys in roles.REGISTRATION_METADATA.values():
        for key in keys:
            assert f"| `{key}` |" in hooks_md, f"docs/hooks.md must document register's {key}"


def _optional_members():
    for role, members in sorted(roles.OPTIONAL_MEMBERS.items()):
        for name, default in sorted(members.items()):
            yield role, name, default


@pytest.mark.parametrize(
    "role,name,default",
    list(_optional_members()),
    ids=[f"{r}.{n}" for r, n, _ in _optional_members()],
)
def test_optional_member_documented_with_its_default(role, name, default):
    # One row per member in docs/hooks.md's "Declared optional members" table:
    # | `role` | `name...` | `repr(default)` |
    rows = [
        line
        for line in _read(DOCS / "hooks.md").splitlines()
        if line.startswith(f"| `{role}` | `{name}:") or line.startswith(f"| `{role}` | `{name}(")
    ]
    assert rows, f"docs/hooks.md must list {role} member {name!r} in its optional members table"
    assert rows[0].endswith(f"| `{default!r}` |"), (
        f"docs/hooks.md gives {role}.{name} another default than {default!r}: {rows[0]}"
    )


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(Policy)])
def test_policy_field_documented(field):
    assert f"`{field}`" in _read(DOCS / "policy.md"), f"docs/policy.md must document {field}"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_policy_preset_documented(preset):
    assert f"`{preset}`" in _read(DOCS / "policy.md"), f"docs/policy.md must list preset {preset}"


def _includes():
    for md in sorted(DOCS.rglob("*.md")):
        for m in INCLUDE.finditer(_read(md)):
            yield md, m.group("path"), m.group("code")


@pytest.mark.parametrize(
    "md,path,code",
    list(_includes()),
    ids=[f"{md.name}:{path}" for md, path, _ in _includes()],
)
def test_included_code_matches_file(md, path, code):
    source = ROOT / path
    assert source.is_file(), f"{md.name} includes {path}, which does not exist"
    assert code.strip("\n") in _read(source), (
        f"the block in {md.relative_to(ROOT)} marked `include: {path}` is not a verbatim "
        f"excerpt of that file; copy it again from {path}"
    )


def test_writing_plugins_quotes_the_example_plugin():
    included = {path for md, path, _ in _includes() if md.name == "writing-plugins.md"}
    example = EXAMPLE.relative_to(ROOT).as_posix()
    assert f"{example}/specdec_example_drafter/__init__.py" in included
    assert f"{example}/pyproject.toml" in included
    assert f"{example}/tests/test_example_drafter.py" in included


def test_example_plugin_entry_point():
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    project = tomllib.loads(_read(EXAMPLE / "pyproject.toml"))["project"]
    assert project["name"] == "specdec-example-drafter"
    assert project["entry-points"]["specdec"] == {"example_repeat": "specdec_example_drafter"}
    assert "specdec-core>=0.3,<0.4" in project["dependencies"]


LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize(
    "md", sorted(DOCS.rglob("*.md")), ids=lambda p: p.relative_to(DOCS).as_posix()
)
def test_relative_links_resolve(md):
    broken = [t for t, _ in LINK.findall(_read(md)) if not (md.parent / t).exists()]
    assert not broken, f"{md.relative_to(ROOT)} links to missing files: {broken}"


def test_public_names_in_docs_exist():
    # Names the docs present as ``specdec.<name>`` must be real attributes.
    missing = set()
    for md in DOCS.glob("*.md"):
        for name in re.findall(r"\bspecdec\.([A-Za-z_]\w*)\b", _read(md)):
            if name in specdec.MOVED or name == "training":  # 0.2 names, in the docs'
                continue  # table of where each went
            if hasattr(specdec, name) or importlib.util.find_spec(f"specdec.{name}"):
                continue
            missing.add(f"{md.name}: specdec.{name}")
    assert not missing, sorted(missing)


def call_signature(fn, *, skip_self: bool = False) -> str:
    """``fn``'s parameters as a call would show them: no annotations, ``repr`` defaults."""
    parts = []
    star_done = False
    for p in inspect.signature(fn).parameters.values():
        if skip_self and p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
            parts.append(f"*{p.name}")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        else:
            parts.append(p.name + ("" if p.default is p.empty else f"={p.default!r}"))
    return f"({', '.join(parts)})"


def _kit_callables():
    import specdec.testing as kit

    for name in kit.__all__:
        obj = getattr(kit, name)
        if inspect.isclass(obj):
            yield name, f"{name}{call_signature(obj.__init__, skip_self=True)}"
        elif inspect.isfunction(obj):
            yield name, f"{name}{call_signature(obj)}"


@pytest.mark.parametrize(
    "name,signature", list(_kit_callables()), ids=[n for n, _ in _kit_callables()]
)
def test_test_kit_documented_with_signature(name, signature):
    assert normalize(signature) in normalize(_read(DOCS / "testing-plugins.md")), (
        f"docs/testing-plugins.md must document {signature}"
    )


def test_test_kit_names_documented():
    import specdec.testing as kit

    text = _read(DOCS / "testing-plugins.md")
    missing = [n for n in kit.__all__ if f"`{n}" not in text and f"{n}(" not in text]
    assert not missing, f"docs/testing-plugins.md does not mention {missing}"


def _bench_flags() -> list[str]:
    import argparse

    from specdec.bench.command import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(), func=None)
    (bench,) = parser._subparsers._group_actions[0].choices.values()
    return [
        max(a.option_strings, key=len)
        for a in bench._actions
        if a.option_strings and a.dest != "help"
    ]


@pytest.mark.parametrize("flag", _bench_flags())
def test_bench_flags_documented(flag):
    assert f"`{flag}" in _read(DOCS / "bench.md"), f"docs/bench.md must document {flag}"


def test_bench_record_fields_documented():
    from specdec.bench import RECORD_FIELDS

    text = _read(DOCS / "bench.md")
    missing = [f for f in RECORD_FIELDS if f'"{f}"' not in text]
    assert not missing, f"docs/bench.md's JSON example lacks {missing}"


def test_test_file_names_are_unique_across_the_suites():
    """The tests session collects the core's and every plugin's suite in one pytest run
    (rootdir-relative imports, no packages): two test files of one name there fail
    collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    dirs = [TESTS, *ROOT.glob("plugins/*/tests"), *ROOT.glob("docs/examples/*/tests")]
    for d in dirs:
        for f in d.rglob("test_*.py"):
            assert f.name not in seen, f"{f.relative_to(ROOT)} and {seen[f.name].relative_to(ROOT)}"
            seen[f.name] = f
    assert len(seen) > 50
