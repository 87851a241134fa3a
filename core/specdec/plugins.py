"""The plugin host: a pluggy manager, entry-point loading, and the component registry.

Plugins are found through the entry-point group ``specdec``. A plugin whose
import or ``load()`` raises is skipped and recorded as a :class:`PluginFailure`;
a plugin that fails pluggy validation, or two distributions registering the
same component name, is a :class:`~specdec.errors.PluginConflictError`.

Capabilities are declared when a component is registered (``register(name, factory,
needs=..., provides=..., supports_batch=...)``, or the factory class's attributes) and
kept on its :class:`ComponentInfo`, so a policy is checked without building anything.

A distribution may name what it provides in the entry-point group ``specdec_provides``
(``<component or preset name> = "<its plugin module>"``): when such a name is missing
because the distribution is installed but not loaded (``SPECDEC_PLUGINS``, a failed
load, a host built without entry points), the error says so. The core itself names no
plugin's components.

Environment:
    ``SPECDEC_PLUGINS``: comma-separated allow-list of distribution names to
    load third-party plugins from (empty string: none). Unset: all.
    ``SPECDEC_TRACE_PLUGINS=1``: print every hook call to stderr.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import importlib_metadata
import pluggy

from . import hookspecs
from .errors import PluginConflictError, UnknownComponentError
from .options import check_signature
from .roles import CAPABILITIES, OPTIONAL_MEMBERS, REGISTRATION_METADATA, ROLES
from .rollback import RollbackPlan, build_plan

ENTRY_POINT_GROUP = "specdec"
#: The entry-point group in which a distribution names the components and presets it
#: provides (read for error messages only; nothing in it is loaded).
PROVIDES_GROUP = "specdec_provides"
CORE_DISTRIBUTION = "specdec-core"

_HOOK_BY_ROLE = {
    "drafter": "specdec_register_drafters",
    "verifier": "specdec_register_verifiers",
    "acceptor": "specdec_register_acceptors",
    "cache_rollback": "specdec_register_cache_rollbacks",
    "governor": "specdec_register_governors",
    "draft_head": "specdec_register_draft_heads",
}


def core_version() -> str:
    """The installed version of specdec-core (``0+unknown`` when run from a source tree)."""
    try:
        return importlib_metadata.version(CORE_DISTRIBUTION)
    except importlib_metadata.PackageNotFoundError:
        return "0+unknown"


@attrs.frozen
class ComponentInfo:
    """One registered component: its role, name, factory, where it came from, and what
    it declared at registration.

    Attributes:
        needs: verifier capabilities a drafter needs (empty for other roles).
        provides: capabilities a verifier provides (empty for other roles).
        supports_batch: whether a drafter, verifier or governor runs rows of a batch.
    """

    role: str
    name: str
    factory: Callable[..., Any]
    plugin: str
    distribution: str
    version: str
    description: str = ""
    needs: frozenset = frozenset()
    provides: frozenset = frozenset()
    supports_batch: bool = False


@attrs.frozen
class PresetInfo:
    """One registered preset policy and where it came from."""

    name: str
    policy: Any
    plugin: str
    distribution: str
    version: str
    description: str = ""


@attrs.frozen
class PluginInfo:
    """A loaded plugin: entry-point name, distribution and version."""

    name: str
    distribution: str
    version: str


@attrs.frozen
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    entry_point: str
    distribution: str
    version: str
    core_version: str
    error: str


class PluginHost:
    """A pluggy plugin manager plus the registry of components it produced."""

    def __init__(
        self, *, load_entry_points: bool = True, entry_points: Iterable[Any] | None = None
    ):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.failures: list[PluginFailure] = []
        self._dist_of: dict[str, PluginInfo] = {}
        self.components: dict[str, dict[str, ComponentInfo]] = {role: {} for role in ROLES}
        #: Preset policies by name (the core's and the plugins'), in registration order.
        self.presets: dict[str, PresetInfo] = {}
        # Built draft heads: id(model) -> (weak ref to the model, {(name, options): head}).
        # (mlx modules are dicts, so not hashable: keyed by id, dropped with the model.)
        self._heads: dict[int, tuple] = {}
        self._collected = False
        self.trace = os.environ.get("SPECDEC_TRACE_PLUGINS", "") not in ("", "0")
        if self.trace:
            self.pm.trace.root.setwriter(lambda s: sys.stderr.write(f"specdec trace: {s}"))
            self.pm.enable_tracing()

        from . import builtins as _builtins

        self.register_plugin(_builtins, name="specdec.builtins", distribution=CORE_DISTRIBUTION)
        if load_entry_points:
            eps = entry_points if entry_points is not None else _entry_points()
            self._load_entry_points(eps)
        self._collect()

    # -- loading -----------------------------------------------------------------

    def _load_entry_points(self, eps: Iterable[Any]) -> None:
        allow = os.environ.get("SPECDEC_PLUGINS")
        allowed = None if allow is None else {a.strip() for a in allow.split(",") if a.strip()}
        for ep in eps:
            dist_name, dist_version = _dist_of(ep)
            if allowed is not None and dist_name not in allowed:
                continue
            try:
                obj = ep.load()
            except Exception as exc:  # a broken plugin must not stop the program
                self.failures.append(
                    PluginFailure(
                        entry_point=ep.name,
                        distribution=dist_name,
                        version=dist_version,
                        core_version=core_version(),
                        error=f"{type(exc).__name__}: {exc}",
                    )
                )
                print(
                    f"specdec: skipped plugin {ep.name!r} from {dist_name} {dist_version} "
                    f"(specdec-core {core_version()}): {type(exc).__name__}: {exc}",
                    file=sys.stderr,
                )
                continue
            self.register_plugin(obj, name=ep.name, distribution=dist_name, version=dist_version)

    def register_plugin(
        self, obj: Any, *, name: str, distribution: str, version: str | None = None
    ) -> None:
        """Register a plugin module or object (tests use this to add plugins by hand).

        Raises:
            PluginConflictError: the plugin fails pluggy validation (names the distribution).
        """
        version = version or (core_version() if distribution == CORE_DISTRIBUTION else "unknown")
        try:
            self.pm.register(obj, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginConflictError(
                f"plugin {name!r} from distribution {distribution} {version} is invalid: {exc}"
            ) from exc
        except ValueError as exc:  # already registered under that name
            other = self._dist_of.get(name)
            raise PluginConflictError(
                f"plugin name {name!r} is registered twice: by "
                f"{other.distribution if other else 'another distribution'} and by {distribution}"
            ) from exc
        info = PluginInfo(name=name, distribution=distribution, version=version)
        self._dist_of[name] = info
        self.plugins.append(info)
        if self._collected:
            self.refresh()

    def refresh(self) -> None:
        """Re-run the registration hooks of every registered plugin (after adding one by hand)."""
        self._collect()

    def _collect(self) -> None:
        for role in ROLES:
            self.components[role] = {}
        self.presets = {}
        self._collected = True
        for role, hook_name in _HOOK_BY_ROLE.items():
            hook = getattr(self.pm.hook, hook_name)
            # Each implementation is called on its own so every name is tied to
            # its distribution; no order between plugins is promised.
            for impl in hook.get_hookimpls():
                self._call_register(role, hook_name, impl, self._plugin_of(impl))
        # The core's presets first (its hook implementation was registered first), then
        # the plugins' in load order.
        for impl in self.pm.hook.specdec_register_policies.get_hookimpls():
            self._call_register_policies(impl, self._plugin_of(impl))

    def _plugin_of(self, impl: Any) -> PluginInfo:
        return self._dist_of.get(impl.plugin_name) or PluginInfo(
            impl.plugin_name, "unknown", "unknown"
        )

    def _call_register(self, role: str, hook_name: str, impl: Any, plugin: PluginInfo) -> None:
        table = self.components[role]

        def register(
            name: str,
            factory: Callable[..., Any],
            *,
            description: str = "",
            needs: Iterable[str] | None = None,
            provides: Iterable[str] | None = None,
            supports_batch: bool | None = None,
        ) -> None:
            where = f"plugin {plugin.name!r} ({plugin.distribution})"
            if not isinstance(name, str) or not name:
                raise PluginConflictError(
                    f"{where} registered a {role} with an invalid name {name!r}: "
                    "expected a non-empty string"
                )
            if not callable(factory):
                raise PluginConflictError(
                    f"{where} registered {role} {name!r} "
                    f"with a factory that is not callable: {factory!r}"
                )
            if name in table:
                other = table[name]
                raise PluginConflictError(
                    f"{role} {name!r} is registered by two distributions: "
                    f"{other.distribution} (plugin {other.plugin!r}) and "
                    f"{plugin.distribution} (plugin {plugin.name!r})"
                )
            given = {"needs": needs, "provides": provides, "supports_batch": supports_batch}
            declared = _declared(where, role, name, factory, given)
            table[name] = ComponentInfo(
                role=role,
                name=name,
                factory=factory,
                plugin=plugin.name,
                distribution=plugin.distribution,
                version=plugin.version,
                description=description,
                **declared,
            )

        self._trace(hook_name, plugin)
        # Hooks grow by adding arguments: pass only those the implementation declares.
        available = {"register": register}
        impl.function(**{k: v for k, v in available.items() if k in impl.argnames})

    def _call_register_policies(self, impl: Any, plugin: PluginInfo) -> None:
        from .policy import Policy

        def register(name: str, policy: Any, *, description: str = "") -> None:
            where = f"plugin {plugin.name!r} ({plugin.distribution})"
            if not isinstance(name, str) or not name:
                raise PluginConflictError(
                    f"{where} registered a preset with an invalid name {name!r}: "
                    "expected a non-empty string"
                )
            if name in self.presets:
                other = self.presets[name]
                raise PluginConflictError(
                    f"preset {name!r} is registered by two distributions: "
                    f"{other.distribution} (plugin {other.plugin!r}) and "
                    f"{plugin.distribution} (plugin {plugin.name!r})"
                )
            if isinstance(policy, Mapping):
                policy = Policy.from_dict({"name": name, **policy})
            if not isinstance(policy, Policy):
                raise PluginConflictError(
                    f"{where} registered preset {name!r} with policy={policy!r}: "
                    "expected a specdec.Policy or a dict of its fields"
                )
            if policy.name != name:
                raise PluginConflictError(
                    f"{where} registered preset {name!r} with a policy named "
                    f"{policy.name!r}: a preset's policy carries its name"
                )
            self.presets[name] = PresetInfo(
                name=name,
                policy=policy,
                plugin=plugin.name,
                distribution=plugin.distribution,
                version=plugin.version,
                description=description,
            )

        self._trace("specdec_register_policies", plugin)
        available = {"register": register}
        impl.function(**{k: v for k, v in available.items() if k in impl.argnames})

    def _trace(self, hook_name: str, plugin: PluginInfo) -> None:
        if self.trace:
            print(
                f"specdec trace: {hook_name}(register) -> plugin {plugin.name!r} "
                f"({plugin.distribution} {plugin.version})",
                file=sys.stderr,
            )

    # -- lookup ------------------------------------------------------------------

    def names(self, role: str) -> list[str]:
        """Installed component names for ``role``, sorted."""
        return sorted(self.components[role])

    def get(self, role: str, name: str) -> ComponentInfo:
        """Look up a component.

        Raises:
            UnknownComponentError: naming what is installed and which distribution
                would provide ``name`` when that is known.
        """
        try:
            return self.components[role][name]
        except KeyError:
            pass
        installed = ", ".join(self.names(role)) or "(none)"
        hint = self.not_loaded_hint(name)
        if not hint:
            for other_role in ROLES:
                if other_role != role and name in self.components[other_role]:
                    hint = f"; {name!r} is a {other_role}, not a {role}"
        raise UnknownComponentError(
            f"unknown {role} {name!r}: installed {role}s are {installed}{hint}"
        )

    def not_loaded_hint(self, name: str) -> str:
        """``"; 'x' is provided by <distribution>, ..."`` when an installed distribution
        declares ``name`` (entry-point group ``specdec_provides``) but its plugin is not
        loaded here; else ``""``."""
        loaded = {p.distribution for p in self.plugins}
        for dist in _declared_providers().get(name, ()):
            if dist not in loaded:
                return (
                    f"; {name!r} is provided by {dist} (pip install {dist}), which is installed "
                    "but not loaded (see SPECDEC_PLUGINS and `specdec plugins`)"
                )
        return ""

    def preset(self, name: str) -> Any:
        """The preset policy ``name``.

        Raises:
            KeyError: no loaded plugin (nor the core) registers that preset.
        """
        return self.presets[name].policy

    def create(self, role: str, name: str, options: dict | None = None) -> Any:
        """Instantiate component ``name`` of ``role`` with ``options``.

        Raises:
            UnknownComponentError: ``name`` is not installed.
            PolicyError: the factory rejected the options.
        """
        from .errors import PolicyError

        info = self.get(role, name)
        options = dict(options or {})
        # Only a signature mismatch is "bad options"; a TypeError raised inside the
        # factory is a bug in the component and propagates as it is.
        try:
            sig = inspect.signature(info.factory, eval_str=True)
        except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated here
            try:
                sig = inspect.signature(info.factory)
            except (TypeError, ValueError):  # builtins without a signature: call and see
                sig = None
        if sig is not None:
            try:
                sig.bind(**options)
            except TypeError as exc:
                params = [
                    p.name
                    for p in sig.parameters.values()
                    if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                ]
                raise PolicyError(
                    f"bad options for {role} {name!r} ({info.distribution}): {exc}; "
                    f"got {sorted(options)}, accepted options are {params}"
                ) from exc
            # A component that takes its options as keyword parameters declares their
            # types by annotation or default: a value of another type fails here, not
            # inside the first propose.
            check_signature(f"{role} {name!r} ({info.distribution})", sig, options)
        return info.factory(**options)

    def draft_head(self, name: str, options: dict | None, model: Any, tokenizer: Any = None) -> Any:
        """The draft head ``name`` with ``options`` for ``model``: built and bound once
        (``bind(model, tokenizer=tokenizer)`` where its ``bind`` takes a tokenizer), then
        shared by every drafter (and pipeline) that names it.

        Raises:
            UnknownComponentError: ``name`` is not an installed draft head.
            PolicyError: bad options.
        """
        # one head per tokenizer too: a head may read it when it is bound
        key = (name, _freeze(options or {}), id(tokenizer) if tokenizer is not None else None)
        entry = self._heads.get(id(model))
        if entry is None or entry[0]() is not model:
            key_id = id(model)
            ref = weakref.ref(model, lambda _r, k=key_id, h=self._heads: h.pop(k, None))
            entry = self._heads[key_id] = (ref, {})
        per_model = entry[1]
        head = per_model.get(key)
        if head is None:
            from .heads import bind_head

            head = bind_head(self.create("draft_head", name, options), model, tokenizer)
            per_model[key] = head
        return head

    def to_dict(self, *, include_builtins: bool = True) -> dict:
        """A JSON-able description of plugins, components and failures."""
        plugins = []
        for p in self.plugins:
            if not include_builtins and p.distribution == CORE_DISTRIBUTION:
                continue
            comps = {
                role: sorted(n for n, c in self.components[role].items() if c.plugin == p.name)
                for role in ROLES
            }
            plugins.append(
                {
                    "name": p.name,
                    "distribution": p.distribution,
                    "version": p.version,
                    "components": {r: v for r, v in comps.items() if v},
                }
            )
        return {
            "core_version": core_version(),
            "plugins": plugins,
            "failures": [attrs.asdict(f) for f in self.failures],
        }


def _declared(
    where: str, role: str, name: str, factory: Callable[..., Any], given: dict[str, Any]
) -> dict[str, Any]:
    """The registration metadata of a component: each value given to ``register``
    (validated), else the factory class's attribute, else the role's default."""
    allowed = REGISTRATION_METADATA.get(role, ())
    out: dict[str, Any] = {}
    for key, value in given.items():
        if value is not None and key not in allowed:
            takers = [r for r, keys in REGISTRATION_METADATA.items() if key in keys]
            raise PluginConflictError(
                f"{where} registered {role} {name!r} with {key}={value!r}: only "
                f"{', '.join(r + 's' for r in takers)} declare {key}"
            )
        if key not in allowed:
            continue
        explicit = value is not None
        if not explicit:
            # read once, here: a class's attribute is what its instances declare
            value = _class_attributes(factory).get(key, OPTIONAL_MEMBERS[role][key])
        if key == "supports_batch":
            if not isinstance(value, bool):
                raise PluginConflictError(
                    f"{where} registered {role} {name!r} with supports_batch={value!r}"
                    f"{'' if explicit else ' (its class attribute)'}: expected True or False"
                )
            out[key] = value
            continue
        if isinstance(value, str) or not isinstance(value, Iterable):
            raise PluginConflictError(
                f"{where} registered {role} {name!r} with {key}={value!r}"
                f"{'' if explicit else ' (its class attribute)'}: expected a set of "
                f"capabilities from {list(CAPABILITIES)}"
            )
        value = frozenset(value)
        # Only what register() was given is checked against CAPABILITIES here: a class
        # attribute naming an unknown capability is refused when a policy names the
        # component (specdec.composition.check_needs), so one stray class does not stop
        # every plugin from loading.
        unknown = sorted(str(v) for v in value - set(CAPABILITIES))
        if explicit and unknown:
            raise PluginConflictError(
                f"{where} registered {role} {name!r} with {key}={sorted(value)}: "
                f"{unknown} are no verifier capabilities; capabilities are {list(CAPABILITIES)}"
            )
        out[key] = value
    return out


def _class_attributes(factory: Any) -> dict[str, Any]:
    """The class attributes of ``factory`` (its MRO's, nearest first) when it is a
    class; ``{}`` for a function or another callable."""
    if not isinstance(factory, type):
        return {}
    out: dict[str, Any] = {}
    for klass in reversed(factory.__mro__):
        out.update(vars(klass))
    return out


def _declared_providers() -> dict[str, list[str]]:
    """``{name: [distribution, ...]}`` from the installed distributions' ``specdec_provides``
    entry points (nothing is loaded)."""
    out: dict[str, list[str]] = {}
    for ep in importlib_metadata.entry_points(group=PROVIDES_GROUP):
        out.setdefault(ep.name, []).append(_dist_of(ep)[0])
    return out


def _freeze(value: Any) -> Any:
    """A hashable form of an options value (dicts and lists nested)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return id(value)
    return value


def _entry_points() -> list[Any]:
    return list(importlib_metadata.entry_points(group=ENTRY_POINT_GROUP))


def _dist_of(ep: Any) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("unknown", "unknown")
    try:
        return (dist.metadata["Name"] or dist.name, dist.version)
    except Exception:  # pragma: no cover - defensive: odd metadata
        return (getattr(dist, "name", "unknown"), getattr(dist, "version", "unknown"))


_host: PluginHost | None = None
_lock = threading.Lock()


def get_plugin_host() -> PluginHost:
    """The process-wide plugin host, created on first use."""
    global _host
    with _lock:
        if _host is None:
            _host = PluginHost()
        return _host


def reset_plugin_host(host: PluginHost | None = None) -> None:
    """Drop (or replace) the process-wide host; the next :func:`get_plugin_host` reloads plugins."""
    global _host
    with _lock:
        _host = host


def get_plugin_manager() -> pluggy.PluginManager:
    """The pluggy manager of the process-wide host."""
    return get_plugin_host().pm


def rollback_plan(
    caches: list, *, model: Any = None, host: Any = None, policy: Any = None
) -> RollbackPlan:
    """A :class:`RollbackPlan` over ``caches`` from every registered cache rollback (public API).

    A drafter with a cache of its own (a draft model, an MTP head) rolls it back
    with ``plan = specdec.rollback_plan(cache, model=m, host=ctx.host)``; then
    ``txn = plan.begin()`` before feeding speculative tokens and
    ``txn.commit(n_fed, n_keep)`` (or ``txn.abort()``) after. ``plan.ok`` says
    whether every layer can be rolled back and ``plan.reason`` why not.

    Args:
        caches: the per-layer cache list.
        model: the model owning ``caches`` (rollbacks that map caches to layers need it).
        host: the plugin host (default: the process-wide one).
        policy: a policy whose ``rollback`` and options apply (default: ``auto``).
    """
    return build_plan(host or get_plugin_host(), caches, model=model, policy=policy)
