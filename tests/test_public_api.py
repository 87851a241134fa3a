"""The core's public surface (core 0.3): a short top level, the rest in submodules."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import specdec


def test_the_top_level_is_short_and_every_name_exists():
    assert len(specdec.__all__) <= 45
    assert len(set(specdec.__all__)) == len(specdec.__all__)
    for name in specdec.__all__:
        assert getattr(specdec, name) is not None, name
    # the names a user meets first
    for name in ("assemble", "Pipeline", "Policy", "Request", "Batch", "Drafter", "hookimpl"):
        assert name in specdec.__all__


@pytest.mark.parametrize("name", sorted(specdec.MOVED))
def test_a_moved_name_still_resolves_with_a_deprecation_warning(name):
    where = importlib.import_module(f"specdec.{specdec.MOVED[name]}")
    with pytest.warns(DeprecationWarning, match=f"specdec.{specdec.MOVED[name]}.{name}"):
        value = getattr(specdec, name)
    assert value is getattr(where, name)
    assert name not in specdec.__all__


def test_unknown_and_removed_names_fail_clearly():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        specdec.nope  # noqa: B018
    with pytest.raises(AttributeError, match="specdec-train"):
        specdec.training  # noqa: B018


def test_import_specdec_loads_no_training_bench_or_distributed_code():
    code = (
        "import sys, specdec; "
        "print(sorted(m for m in sys.modules if m.startswith(('specdec.training', "
        "'specdec.bench', 'specdec.distributed', 'specdec_train'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # and the distributed module is there when asked for
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert specdec.distributed.RankSync is not None
