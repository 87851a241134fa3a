"""Drive a drafter session by hand in unit tests: a request context and committed rounds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..plugins import get_plugin_host
from ..roles import RequestContext, RoundResult


def request_context(
    prompt: Sequence[int], *, max_tokens: int = 64, **fields: Any
) -> RequestContext:
    """A :class:`specdec.RequestContext` for ``prompt`` without a model, for calling
    ``Drafter.session(ctx)`` directly; ``fields`` set any other field (``options``,
    ``cost``, ``model``...; ``host`` is the process-wide plugin host unless given)."""
    base: dict[str, Any] = dict(
        model=None,
        tokenizer=None,
        prompt_tokens=[int(t) for t in prompt],
        max_tokens=max_tokens,
        sampler=None,
        caches=[],
    )
    base.update(fields)
    if base.get("host") is None:
        base["host"] = get_plugin_host()
    return RequestContext(**base)


def feed_round(
    session: Any,
    history: Sequence[int],
    tokens: Sequence[int],
    *,
    block: Sequence[int] = (),
    n_accepted: int = 0,
    drafter: str | None = None,
) -> list[int]:
    """Tell ``session`` (its ``observe``) that a round committed ``tokens`` right after
    ``history``, as the pipeline would (``block`` and ``n_accepted``: what was verified;
    ``drafter``: whose block it was); returns the new history."""
    tokens = tuple(int(t) for t in tokens)
    if not tokens:
        raise ValueError("feed_round: a round commits at least one token")
    session.observe(
        RoundResult(
            drafter=drafter,
            block=tuple(block),
            n_accepted=n_accepted,
            token=tokens[-1],
            committed=tokens,
            start_position=len(history),
        )
    )
    return list(history) + list(tokens)
