"""Exceptions raised by specdec. Every message says what was wrong and what is accepted."""

from __future__ import annotations


class SpecdecError(Exception):
    """Base class of every error specdec raises on purpose."""


class PolicyError(SpecdecError, ValueError):
    """A policy (preset name, dict, TOML file or object) is malformed."""


class UnknownComponentError(PolicyError):
    """A policy names a component that no installed plugin registers."""


class PluginConflictError(SpecdecError):
    """Two distributions register the same component name, or a plugin fails validation."""


class RequestError(SpecdecError, ValueError):
    """A generation request has a bad argument (max_tokens, temperature, top_p, ...)."""


class ModelLoadError(SpecdecError, ValueError):
    """A model or draft model cannot be loaded or does not fit the target."""


class DistributedError(SpecdecError, RuntimeError):
    """The ranks of a sharded model disagreed, or one of them failed: the request ended
    on every rank."""
