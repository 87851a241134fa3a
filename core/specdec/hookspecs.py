"""Hook specifications of specdec: one registration hook per role.

Each hook receives a ``register`` callback. Call it once per component::

    register(
        name: str,
        factory: Callable[..., Component],
        *,
        description: str = "",
        needs: Iterable[str] | None = None,        # drafters
        provides: Iterable[str] | None = None,     # verifiers
        supports_batch: bool | None = None,        # drafters, verifiers, governors
    )

The keyword metadata declares what the core checks before it builds anything (a
policy's verifier provides what its drafters need; every component of a batched
policy runs rows of a batch). A value left out comes from the factory's class
attribute of that name when the factory is a class (read once, at registration),
else the role's default (:data:`specdec.roles.OPTIONAL_MEMBERS`: no needs, provides
``logits``, no batch). A value given for a role that does not declare it, of the
wrong type, or naming a capability outside :data:`specdec.roles.CAPABILITIES` is a
:class:`specdec.PluginConflictError` naming the plugin and the argument.

``factory(**options)`` is called with the options the policy gives for
``name`` and returns the component: drafters, governors, verifiers and
acceptors once per pipeline (at :func:`specdec.assemble`, so bad names and
options fail before any model work; drafters and governors then make a
session per request), cache rollbacks once per request, draft heads once per
(model, options) and shared by the drafters that name them. Hooks run when
plugins are loaded; none is called inside the per-token loop.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "specdec"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def specdec_register_drafters(register):
    """Register Drafter factories: ``register(name, factory, description=..., needs=..., supports_batch=...)``."""


@hookspec
def specdec_register_verifiers(register):
    """Register Verifier factories: ``register(name, factory, description=..., provides=..., supports_batch=...)``."""


@hookspec
def specdec_register_acceptors(register):
    """Register Acceptor factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_cache_rollbacks(register):
    """Register CacheRollback factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_governors(register):
    """Register Governor factories: ``register(name, factory, description=..., supports_batch=...)``."""


@hookspec
def specdec_register_draft_heads(register):
    """Register DraftHead factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_policies(register):
    """Register preset policies: ``register(name, policy, description=...)``.

    ``policy`` is a :class:`specdec.Policy` named ``name``, or a dict of its fields (its
    ``name`` defaults to ``name``). A preset may name components of other plugins;
    :func:`specdec.assemble` fails with the list of what is installed when one is missing.
    """


@hookspec
def specdec_register_commands(subparsers):
    """Add subcommands to the ``specdec`` command (as ``llm``'s ``register_commands``).

    ``subparsers`` is argparse's subparsers action of the ``specdec`` parser: call
    ``subparsers.add_parser(name, help=...)``, add arguments, and
    ``parser.set_defaults(func=run)`` with ``run(args) -> int`` (the exit status).
    Called once per ``specdec`` invocation, after the core's own subcommands; an
    implementation that raises, or adds a name that is taken, is left out with a
    warning on stderr.
    """
