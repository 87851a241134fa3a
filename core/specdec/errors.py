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


class ComponentError(SpecdecError, RuntimeError):
    """A component (drafter, governor, acceptor, rollback, verifier, draft head) raised or
    broke its contract during a request.

    The message names the component (its role, name, distribution and version), the
    request's round and position and what was wrong; an exception the component raised
    is the ``__cause__``. The request ends with this error; the caches are restored and
    the pipeline serves the next request (a batch: that row alone ends).

    Attributes:
        role: ``"drafter"``, ``"governor"``, ``"acceptor"``, ``"rollback"``, ...
        component: the component's name in the policy.
        distribution: the distribution that registered it, with its version.
        round: the request's round (1 = the first round after the prefill; 0 = while
            opening or prefilling the request).
        position: the absolute position of the round's first token (``None`` outside a
            round).
        call: the method that raised or whose result was wrong (``"propose"``, ...).
    """

    def __init__(
        self,
        message: str,
        *,
        role: str = "",
        component: str = "",
        distribution: str = "",
        round: int = 0,
        position: int | None = None,
        call: str = "",
    ):
        super().__init__(message)
        self.role, self.component, self.distribution = role, component, distribution
        self.round, self.position, self.call = round, position, call


class DraftError(ComponentError, ValueError):
    """A drafter proposed a block that breaks the :class:`specdec.Draft` contract: a token
    id outside ``[0, vocab_size)`` or not an integer, a block longer than the length it
    was offered, or draft probabilities ``q`` of the wrong shape, not finite, negative,
    or zero at a drafted token."""
