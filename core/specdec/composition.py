"""Composition checks: whether a policy's components fit together, before any model work.

:func:`check_needs` (a drafter's needs against the verifier's capabilities) and
:func:`check_batch` (every component can run rows of a batch) raise a
:class:`~specdec.errors.PolicyError` that names what is wrong and which installed
components would serve.
"""

from __future__ import annotations

from typing import Any

from .errors import PolicyError
from .plugins import PluginHost
from .policy import Policy
from .roles import CAPABILITIES

__all__ = ["check_batch", "check_needs", "provides", "supports_batch"]


def provides(host: PluginHost, name: str, options: dict) -> frozenset:
    """What verifier ``name`` provides: its class attribute, else an instance's."""
    info = host.get("verifier", name)
    p = getattr(info.factory, "provides", None)
    if p is None:
        p = getattr(host.create("verifier", name, options), "provides", None)
    return frozenset(p or ("logits",))


def check_needs(host: PluginHost, policy: Policy, drafter: str, needs: Any) -> None:
    """Raise a PolicyError when the policy's verifier lacks something ``drafter`` needs."""
    if not needs:
        return
    unknown = sorted(set(needs) - set(CAPABILITIES))
    if unknown:
        raise PolicyError(
            f"drafter {drafter!r} needs {unknown}, which is no verifier capability; "
            f"capabilities are {list(CAPABILITIES)}"
        )
    have = provides(host, policy.verifier, policy.options_for(policy.verifier))
    missing = sorted(set(needs) - have)
    if not missing:
        return
    need = missing[0]
    offer = []
    for v in host.names("verifier"):
        try:
            if need in provides(host, v, policy.options_for(v)):
                offer.append(v)
        except Exception:  # a verifier that cannot be built with defaults offers nothing
            continue
    hint = (
        f"installed verifiers that provide it: {', '.join(offer)}; set verifier = "
        f"'{offer[0]}' in the policy"
        if offer
        else "no installed verifier provides it"
    )
    raise PolicyError(
        f"drafter {drafter!r} needs {need!r}, which verifier {policy.verifier!r} does not "
        f"provide (it provides {', '.join(sorted(have))}); {hint}"
    )


def supports_batch(host: PluginHost, role: str, name: str, options: dict) -> bool:
    """Whether component ``name`` declares ``supports_batch``: its factory, else an instance."""
    info = host.get(role, name)
    flag = getattr(info.factory, "supports_batch", None)
    if flag is None:
        flag = getattr(host.create(role, name, options), "supports_batch", False)
    return bool(flag)


def check_batch(host: PluginHost, policy: Policy, rows: int | None = None) -> None:
    """Refuse rows of a batch (``rows``, default the policy's ``max_batch``) when a
    component of the policy cannot run them."""
    rows = policy.max_batch if rows is None else rows
    wanted = [("drafter", n) for n in policy.drafters] + [("verifier", policy.verifier)]
    if policy.governor:
        wanted.append(("governor", policy.governor))
    for role, name in wanted:
        if supports_batch(host, role, name, policy.options_for(name)):
            continue
        able = []
        for n in host.names(role):
            try:
                if supports_batch(host, role, n, policy.options_for(n)):
                    able.append(n)
            except Exception:  # a component that cannot be built with defaults offers nothing
                continue
        info = host.get(role, name)
        raise PolicyError(
            f"policy {policy.name!r} decodes {rows} rows of a batch, but {role} {name!r} "
            f"({info.distribution}) does not support batched rows (supports_batch is not set); "
            f"installed {role}s that do: {', '.join(able) or '(none)'}; decode one request "
            "at a time (max_batch = 1, Pipeline.stream)"
        )
