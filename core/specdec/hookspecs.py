"""Hook specifications of specdec: one registration hook per role.

Each hook receives a ``register`` callback. Call it once per component::

    register(name: str, factory: Callable[..., Component], *, description: str = "")

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
    """Register Drafter factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_verifiers(register):
    """Register Verifier factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_acceptors(register):
    """Register Acceptor factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_cache_rollbacks(register):
    """Register CacheRollback factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_governors(register):
    """Register Governor factories: ``register(name, factory, description=...)``."""


@hookspec
def specdec_register_draft_heads(register):
    """Register DraftHead factories: ``register(name, factory, description=...)``."""


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
