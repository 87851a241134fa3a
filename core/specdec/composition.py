"""Checks that a policy's components fit together, read off what they declared.

Every check here reads the :class:`~specdec.plugins.ComponentInfo` metadata that a
plugin declared when it registered a component (``needs``, ``provides``,
``supports_batch``); none builds a component, so a policy is checked before any
model work, and a component that cannot be built with default options is still
named in a hint.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import PolicyError
from .plugins import PluginHost
from .policy import Policy
from .roles import CAPABILITIES


def provides(host: PluginHost, verifier: str) -> frozenset:
    """What verifier ``verifier`` declared it provides.

    Raises:
        UnknownComponentError: ``verifier`` is not installed.
    """
    return host.get("verifier", verifier).provides


def check_needs(
    host: PluginHost, policy: Policy, drafter: str, needs: Iterable[str] | None = None
) -> None:
    """Refuse ``policy`` when its verifier lacks a capability that ``drafter`` needs.

    Args:
        host: the plugin host the policy's components come from.
        policy: the policy (its ``verifier`` is checked).
        drafter: the drafter's name.
        needs: what the drafter needs; ``None`` (default): what it declared at registration.
            (A built drafter's own ``needs`` may be passed, to check the instance too.)

    Raises:
        PolicyError: a need that is no capability (naming :data:`~specdec.roles.CAPABILITIES`),
            or one the verifier does not provide (naming the installed verifiers that do).
        UnknownComponentError: the drafter or the verifier is not installed.
    """
    if needs is None:
        needs = host.get("drafter", drafter).needs
    if not needs:
        return
    unknown = sorted(set(needs) - set(CAPABILITIES))
    if unknown:
        raise PolicyError(
            f"drafter {drafter!r} needs {unknown}, which is no verifier capability; "
            f"capabilities are {list(CAPABILITIES)}"
        )
    have = provides(host, policy.verifier)
    missing = sorted(set(needs) - have)
    if not missing:
        return
    need = missing[0]
    offer = [v for v in host.names("verifier") if need in provides(host, v)]
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


def supports_batch(host: PluginHost, role: str, name: str) -> bool:
    """Whether component ``name`` of ``role`` declared that it runs rows of a batch.

    Raises:
        UnknownComponentError: ``name`` is not installed.
    """
    return host.get(role, name).supports_batch


def check_batch(host: PluginHost, policy: Policy, rows: int | None = None) -> None:
    """Refuse rows of a batch (``rows``, default the policy's ``max_batch``) when a
    drafter, the governor or the verifier of ``policy`` did not declare ``supports_batch``.

    Raises:
        PolicyError: naming the component, its distribution and the installed
            components of that role that do support batched rows.
        UnknownComponentError: a component is not installed.
    """
    rows = policy.max_batch if rows is None else rows
    wanted = [("drafter", n) for n in policy.drafters] + [("verifier", policy.verifier)]
    if policy.governor:
        wanted.append(("governor", policy.governor))
    for role, name in wanted:
        if supports_batch(host, role, name):
            continue
        able = [n for n in host.names(role) if supports_batch(host, role, n)]
        info = host.get(role, name)
        raise PolicyError(
            f"policy {policy.name!r} decodes {rows} rows of a batch, but {role} {name!r} "
            f"({info.distribution}) does not support batched rows (supports_batch is not set); "
            f"installed {role}s that do: {', '.join(able) or '(none)'}; decode one request "
            "at a time (max_batch = 1, Pipeline.stream)"
        )
