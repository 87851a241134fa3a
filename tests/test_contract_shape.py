"""The contract's shape, read from the source with ``ast``: the core reads no component
member that :mod:`specdec.roles` does not declare, and reads optional ones through
:func:`specdec.roles.optional` (which knows their defaults), not through ``getattr``.

Checked: the core's modules, ``core/specdec/**.py``, except

- ``roles.py``: it declares the members, and :func:`~specdec.roles.optional` itself is
  the one ``getattr`` of a component member allowed to take any declared name;
- ``cli/`` and ``bench/``: apps on top of the facade (DESIGN's "apps" layer); they read
  argparse namespaces, stats records and result JSON, never a component's members;
- ``models/``: model loaders, reading model configs and GGUF fields only;
- ``testing/``: the test kit for plugins; its fake components and checks inspect
  mlx-lm caches and models, and it may probe a plugin's component on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from specdec import roles

CORE = Path(__file__).resolve().parents[1] / "core" / "specdec"
EXCLUDED_DIRS = {"cli", "bench", "models", "testing"}
EXCLUDED_FILES = {"roles.py"}

#: Every member name the roles declare (required or optional).
DECLARED = frozenset().union(
    *roles.REQUIRED_MEMBERS.values(), *map(set, roles.OPTIONAL_MEMBERS.values())
)

#: Names the core reads with getattr/hasattr from objects that are not components. A
#: name here may also be a component member's (``layers``, ``name``, ``vocab_size``,
#: ``logits``): such a read is allowed in any file, so keep this list short.
NON_COMPONENT = {
    # the tokenizer (mlx-lm TokenizerWrapper / Hugging Face) and what it returns
    "chat_template",
    "detokenizer",
    "eos_token_id",
    "eos_token_ids",
    "keys",  # a BatchEncoding from apply_chat_template; an mlx-lm cache's keys
    # mlx-lm caches and the mlx_lm.models.cache module's classes
    "BatchKVCache",
    "CacheList",
    "ChunkedKVCache",
    "ConcatenateKVCache",
    "KVCache",
    "QuantizedKVCache",
    "merge",
    "extract",
    "offset",
    "state",
    # mlx-lm models, their config (args) and modules
    "args",
    "model",
    "layers",
    "language_model",
    "lm_head",
    "embed_tokens",
    "weight",
    "scales",
    "mode",
    "norm",
    "self_attn",
    "q_proj",
    "mlp",
    "n_heads",
    "n_kv_heads",
    "num_heads",
    "num_key_value_heads",
    "make_cache",
    "model_type",
    "named_modules",
    "parameters",
    "pipeline",
    "pipeline_size",
    "shard",
    "vocab_size",
    # the marker specdec.capture sets on a tapped model class
    "_specdec_tapped",
    # Python and the standard library (classes, exceptions, os, sys, entry points)
    "__dict__",
    "__qualname__",
    "add_note",
    "orig_argv",
    "RTLD_NOLOAD",
    "dist",
    "name",
    "version",
    # specdec.training: argparse namespaces and the trainer of a head kind (not a role)
    "data",
    "kv_layers",
    "eval_logits",
    "logits",
    "extra_loss",
}


def _core_files() -> list[Path]:
    out = []
    for f in sorted(CORE.rglob("*.py")):
        rel = f.relative_to(CORE)
        if rel.parts[0] in EXCLUDED_DIRS or rel.as_posix() in EXCLUDED_FILES:
            continue
        out.append(f)
    return out


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _problems(rel: str, source: str) -> list[str]:
    tree = ast.parse(source, rel)
    bad = []
    for node in sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: n.lineno
    ):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        fname = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
        where = f"{rel}:{node.lineno}"
        if fname == "optional" and len(node.args) == 3:
            role, name = _literal(node.args[1]), _literal(node.args[2])
            if role is None or name is None:
                bad.append(f"{where}: optional() with a role or name that is not a literal")
            elif name not in roles.OPTIONAL_MEMBERS.get(role, {}):
                bad.append(f"{where}: optional(..., {role!r}, {name!r}) is not declared")
        elif isinstance(func, ast.Name) and fname in ("getattr", "hasattr") and len(node.args) >= 2:
            name = _literal(node.args[1])
            if name is None or name in NON_COMPONENT:
                continue  # a computed name (a dispatch), or a read of a non-component
            if name not in DECLARED:
                bad.append(f"{where}: {fname}(..., {name!r}) reads an undeclared name")
            else:
                bad.append(
                    f"{where}: {fname}(..., {name!r}) reads a component member: use "
                    "specdec.roles.optional (or the attribute, for a required member)"
                )
    return bad


def _cases():
    for f in _core_files():
        rel = f.relative_to(CORE).as_posix()
        yield pytest.param(f, id=rel)


@pytest.mark.parametrize("path", list(_cases()))
def test_core_module_reads_only_declared_members(path):
    bad = _problems(path.relative_to(CORE).as_posix(), path.read_text(encoding="utf-8"))
    assert not bad, "\n".join(bad)


def test_the_checked_files_include_the_components():
    names = {f.relative_to(CORE).as_posix() for f in _core_files()}
    assert {"costs.py", "heads.py", "rollback.py", "plugins.py", "composition.py"} <= names
    assert not names & {"roles.py"} and not any(n.startswith("testing/") for n in names)


def test_optional_members_come_from_the_base_classes():
    for role, members in roles.OPTIONAL_MEMBERS.items():
        base = roles.BASES[role]
        for name, default in members.items():
            value = getattr(base, name)
            assert default is (None if callable(value) and not isinstance(value, type) else value)
            assert name not in roles.REQUIRED_MEMBERS[role], (role, name)


def test_every_optional_member_is_named_in_its_protocol():
    for role, members in roles.OPTIONAL_MEMBERS.items():
        doc = roles.PROTOCOLS[role].__doc__ or ""
        for name in members:
            assert f"``{name}" in doc, f"{roles.PROTOCOLS[role].__name__} must name {name!r}"


def test_optional_refuses_an_undeclared_name():
    assert roles.optional(object(), "drafter", "supports_batch") is False
    assert roles.optional(None, "verifier", "provides") == frozenset({"logits"})
    with pytest.raises(LookupError, match="not an optional member of a drafter"):
        roles.optional(object(), "drafter", "supports_batches")
    with pytest.raises(LookupError, match="no role 'drafters'"):
        roles.optional(object(), "drafters", "needs")


def test_the_meta_test_catches_a_stray_read():
    src = (
        "def f(d, model):\n"
        "    a = getattr(d, 'supports_batch', False)\n"
        "    b = getattr(d, 'teleport', None)\n"
        "    c = getattr(model, 'args', None)\n"
        "    return optional(d, 'drafter', 'nope')\n"
    )
    found = _problems("probe.py", src)
    assert len(found) == 3, found
    assert any("'teleport'" in p and "undeclared" in p for p in found)
    assert any("'supports_batch'" in p and "optional" in p for p in found)
    assert any("'nope'" in p for p in found)
