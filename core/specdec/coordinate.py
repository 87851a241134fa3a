"""The coordinate phase: what the processes running one request agree on.

A request decoded by one process has nothing to agree on: :class:`Solo`, whose
every method does nothing. On a model sharded across ranks
(:mod:`specdec.distributed`) each request gets a ``RankCoordinator`` with the same
methods, which keeps the ranks in step: rank 0's seed, rank 0's block and ``q`` each
round, and a failing rank completing the forward the others run. The driver calls
the same methods either way; it never asks which one it has.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["Coordinator", "Solo"]


class Coordinator:
    """The methods a request's coordinator has (this base: a single process).

    Attributes:
        local: the request's decisions are this process's alone, so the driver may
            queue a round ahead (lookahead) and project logits row by row.
    """

    local = True

    def start(self, state: Any) -> None:
        """Before the request's sessions are made (may replace ``state.sampler``)."""

    def opened(self, state: Any) -> None:
        """After the sessions were made, before prefill."""

    def prefill_failed(self, exc: BaseException, logits: Any, chunk: Sequence[int]) -> None:
        """A prefill chunk failed with ``exc`` (``logits``: its forward, if it was built).
        Raise to fail the request now; return to go on feeding (see :meth:`rerun`)."""
        raise exc

    def rerun(self, tokens: Sequence[int]) -> None:
        """Run a forward over ``tokens`` that this process owes the others."""

    def round(self, state: Any, rnd: Any) -> None:
        """Before the verify forward: agree on ``rnd``'s block, ``chosen`` and ``q``."""

    def built(self, out: Any) -> None:
        """The round's forward was built (``out``: its lazy logits)."""

    def round_done(self) -> None:
        """The round's tokens were committed and emitted."""

    def finish(self, state: Any) -> None:
        """The stream ended normally."""

    def fail(self, state: Any, exc: BaseException | None, *, opening: bool = False) -> None:
        """The request failed here with ``exc`` (``None``: its consumer closed the stream;
        ``opening``: while its sessions were made). Never raises."""

    def stats(self, state: Any) -> dict | None:
        """The request's ``stats.distributed`` (``None``: nothing to report)."""
        return None


class Solo(Coordinator):
    """One process decodes the request: nothing to agree on."""
