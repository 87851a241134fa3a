"""Preset policies and turning what a user gives into a :class:`~specdec.policy.Policy`.

:data:`PRESETS` are the presets of the process-wide plugin host (the core registers
``none`` and ``draft``; plugins register theirs through ``specdec_register_policies``);
:func:`load_policy` accepts a preset name, a TOML path, a dict or a Policy;
:func:`default_policy` is what runs when no policy is named.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import PolicyError
from .plugins import get_plugin_host
from .policy import CORE_PRESETS, Policy

__all__ = ["DEFAULT_POLICY", "DEFAULT_PRESET", "PRESETS", "default_policy", "load_policy"]


class _Presets(Mapping):
    """The preset policies of the process-wide plugin host, by name (read-only)."""

    def _table(self) -> dict:
        return get_plugin_host().presets

    def __getitem__(self, name: str) -> Policy:
        return self._table()[name].policy

    def __iter__(self):
        return iter(list(self._table()))

    def __len__(self) -> int:
        return len(self._table())

    def __repr__(self) -> str:
        return f"PRESETS({', '.join(self)})"


#: Preset policies by name: the core's (:data:`CORE_PRESETS`) and those the loaded
#: plugins register, looked up in the process-wide plugin host.
PRESETS: Mapping[str, Policy] = _Presets()


#: The name that stands for :func:`default_policy`: what ``specdec generate`` and
#: :func:`specdec.assemble` run when no policy is named.
DEFAULT_POLICY = "default"
#: The preset :func:`default_policy` picks when its plugins are installed.
DEFAULT_PRESET = "copy"


def default_policy(host: Any = None) -> Policy:
    """The policy that runs when none is named: the ``copy`` preset (``ngram_copy``
    governed by ``copy_governor``) when both plugins are installed, else ``none``
    (plain decoding).

    The ``copy`` preset never slowed a shipped ``specdec bench`` workload on the
    default model by more than the machine's noise, at temperature 0 or 1, and it
    copies up to several times faster where the answer repeats its context (see the
    README); ``policy="none"`` (``--policy none``) always gives plain decoding.

    Args:
        host: the plugin host to look the plugins up in (default: the process-wide one).
    """
    h = host or get_plugin_host()
    info = h.presets.get(DEFAULT_PRESET)
    if info is None:
        return _core("none", h)
    pol = info.policy
    have = set(h.names("drafter")) >= set(pol.drafters) and (
        pol.governor is None or pol.governor in h.names("governor")
    )
    return pol if have else _core("none", h)


def load_policy(
    spec: Policy | str | os.PathLike | Mapping[str, Any] | None,
    *,
    host: Any = None,
    draft_model: bool = False,
) -> Policy:
    """Turn a preset name, TOML path, dict or Policy into a :class:`Policy`.

    ``None`` is ``none`` (plain decoding); ``"default"`` (:data:`DEFAULT_POLICY`) is
    :func:`default_policy` (looked up in ``host``, default: the process-wide one), or
    with ``draft_model`` (a draft model is given and no policy named) the ``draft``
    preset: the draft model drafts alone.

    Raises:
        PolicyError: an unknown preset name (listing the presets), a missing or
            malformed file, or bad values.
    """
    if spec is None:
        return _core("none", host)
    if isinstance(spec, Policy):
        return spec
    if isinstance(spec, Mapping):
        return Policy.from_dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        s = os.fspath(spec)
        if s == DEFAULT_POLICY:
            return _core("draft", host) if draft_model else default_policy(host)
        if s in CORE_PRESETS:
            return _core(s, host)
        h = host or get_plugin_host()
        if s in h.presets:
            return h.presets[s].policy
        if s.endswith(".toml") or os.sep in s or Path(s).is_file():
            return Policy.from_toml(s)
        raise PolicyError(
            f"unknown policy {s!r}: expected {DEFAULT_POLICY!r}, a preset name "
            f"({', '.join(sorted(h.presets))}) "
            f"or a path to a .toml file{h.not_loaded_hint(s)}"
        )
    raise PolicyError(
        f"a policy must be a Policy, a preset name, a .toml path or a dict; got {type(spec).__name__}"
    )


def _core(name: str, host: Any) -> Policy:
    """One of the core's presets, as the host registered it (the same object each time)."""
    info = (host or get_plugin_host()).presets.get(name)
    return info.policy if info is not None else CORE_PRESETS[name]
