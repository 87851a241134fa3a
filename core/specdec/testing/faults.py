"""A drafter's worst cases fed to the loop: every one must end in a clear error or in
output identical to plain decoding, never in a crash or a silent difference.

:func:`check_drafter_faults` wraps one drafter of a policy so that, at a chosen call
of ``propose``, its draft is corrupted (ids outside the vocabulary, a float id, a block
longer than asked, ``q`` with NaN, a negative or a zero at a drafted token, ``q`` of
the wrong shape), or it raises (on the first and on the n-th call, in ``observe``), or
it drafts nothing (an empty block, ``None``). The faulty call replaces the drafter's
own ``propose``: to its session that round is one it was not asked to draft, as when a
governor gives it no budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import mlx.core as mx

from ..assembly import assemble
from ..errors import ComponentError, DraftError
from ..heads import model_vocab_size
from ..presets import load_policy
from ..roles import Draft

__all__ = ["FAULTS", "FaultOutcome", "InjectedFault", "check_drafter_faults"]

#: The faults, with what each must end in: ``"draft"`` a :class:`specdec.DraftError`,
#: ``"raised"`` a :class:`specdec.ComponentError` whose cause is the injected
#: exception, ``"identical"`` output equal to plain decoding.
FAULTS: dict[str, str] = {
    "id_vocab_size": "draft",  # the id one past the last (= vocab_size)
    "id_negative": "draft",  # -1
    "id_huge": "draft",  # 1_000_000 (read out of the embedding's memory, unchecked)
    "id_lazy_out_of_range": "draft",  # vocab_size in a lazy mx.array block
    "id_float": "raised",  # 1.5: Draft() refuses it inside propose
    "over_long": "draft",  # max_len + 1 tokens
    "q_nan": "draft",
    "q_negative": "draft",
    "q_zero_at_drafted": "draft",
    "q_wrong_shape": "draft",
    "raise_first": "raised",  # propose raises on its first call
    "raise_nth": "raised",  # ... on its n-th call
    "raise_in_observe": "raised",
    "empty": "identical",  # Draft(tokens=())
    "none": "identical",  # None
}


class InjectedFault(RuntimeError):
    """The exception a faulty drafter raises (the cause of the error the caller gets)."""


@attrs.frozen
class FaultOutcome:
    """What one fault ended in.

    Attributes:
        fault: its name (a key of :data:`FAULTS`).
        outcome: ``"error"`` or ``"identical"``.
        message: the error's message (empty for ``"identical"``).
    """

    fault: str
    outcome: str
    message: str = ""


class _Faulty:
    """A drafter whose sessions inject ``fault`` (the first session made only)."""

    def __init__(self, inner: Any, fault: str, nth: int, prompt: list, reference: list):
        self._inner, self._fault, self._nth = inner, fault, nth
        # plain decoding's continuation: a drafted token it would not choose is rejected
        self._expected = prompt + reference
        self.sessions = 0
        self.injected = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def session(self, ctx: Any) -> Any:
        s = self._inner.session(ctx)
        self.sessions += 1
        return _FaultySession(self, s, ctx) if self.sessions == 1 else s


class _FaultySession:
    def __init__(self, owner: _Faulty, inner: Any, ctx: Any):
        self._owner, self._inner = owner, inner
        self._vocab = int(model_vocab_size(ctx.model) or 0)
        self._calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def propose(self, history: Sequence[int], max_len: int) -> Any:
        self._calls += 1
        fault, owner = self._owner._fault, self._owner
        at = 1 if fault != "raise_nth" else owner._nth
        if self._calls != at or fault == "raise_in_observe":
            return self._inner.propose(history, max_len)
        # The faulty call replaces the real one: to the drafter's session the round is
        # one it was not asked to draft (as when the governor gives it no budget).
        owner.injected += 1
        if fault in ("raise_first", "raise_nth"):
            raise InjectedFault(f"injected fault {fault!r} in propose call {self._calls}")
        if fault == "empty":
            return Draft(tokens=())
        if fault == "none":
            return None
        v, last = self._vocab, int(history[-1])
        k = min(2, max_len)
        n = len(history)
        expected = owner._expected[n] if n < len(owner._expected) else 0
        wrong = (expected + 1) % v  # rejected at once: acceptance reads q's first row whole
        block = [wrong] * k
        if fault == "id_vocab_size":
            return Draft(tokens=[*block[:-1], v])
        if fault == "id_negative":
            return Draft(tokens=[*block[:-1], -1])
        if fault == "id_huge":
            return Draft(tokens=[*block[:-1], 1_000_000])
        if fault == "id_lazy_out_of_range":
            return Draft(tokens=mx.array([*block[:-1], v], dtype=mx.int32))
        if fault == "id_float":
            return Draft(tokens=[*block[:-1], 1.5])
        if fault == "over_long":
            return Draft(tokens=[last] * (max_len + 1))
        q = mx.full((k, v), 1.0 / v)
        if fault == "q_nan":
            q = mx.where(mx.arange(v) == 0, mx.array(float("nan")), q)
        elif fault == "q_negative":
            q = mx.where(mx.arange(v) == 0, mx.array(-0.5), q)
        elif fault == "q_zero_at_drafted":
            q = mx.where(mx.arange(v) == wrong, mx.array(0.0), q)
        elif fault == "q_wrong_shape":
            q = mx.full((k, v + 1), 1.0 / (v + 1))
        return Draft(tokens=block, probs=q)

    def observe(self, result: Any) -> None:
        self._inner.observe(result)
        owner = self._owner
        if owner._fault == "raise_in_observe" and owner.injected == 0:
            owner.injected += 1
            raise InjectedFault("injected fault 'raise_in_observe'")


def check_drafter_faults(
    model: Any,
    policy: Any,
    prompt_tokens: Sequence[int],
    *,
    drafter: str | None = None,
    faults: Iterable[str] | None = None,
    tokenizer: Any = None,
    max_tokens: int = 16,
    nth: int = 3,
    **generate_kwargs: Any,
) -> list[FaultOutcome]:
    """Feed ``drafter`` (default: the policy's first) every fault of :data:`FAULTS` (or
    ``faults``) on ``prompt_tokens`` and assert each ends as it must: a
    :class:`specdec.DraftError` or :class:`specdec.ComponentError` naming the drafter
    (an injected exception as its ``__cause__``), or greedy output identical to plain
    decoding; after each, the same pipeline still gives plain decoding's output.

    The prompt must be one on which the drafter is asked to propose at least ``nth``
    times in ``max_tokens`` tokens (a copy-heavy prompt for a copy drafter).

    Returns:
        one :class:`FaultOutcome` per fault.

    Raises:
        AssertionError: a fault ended otherwise (naming it and what happened), or was
            never injected (the drafter was asked to propose too few times).
        ValueError: an unknown fault, or ``drafter`` is not one of the policy's.
    """
    pol = load_policy(policy)
    name = drafter or (pol.drafters[0] if pol.drafters else None)
    if name is None or name not in pol.drafters:
        raise ValueError(
            f"check_drafter_faults: drafter {name!r} is not one of policy {pol.name!r}'s "
            f"drafters {list(pol.drafters)}"
        )
    chosen = list(FAULTS) if faults is None else list(faults)
    unknown = [f for f in chosen if f not in FAULTS]
    if unknown:
        raise ValueError(f"check_drafter_faults: unknown faults {unknown}; known: {list(FAULTS)}")
    plain = assemble(model, tokenizer, "none")
    spec = assemble(model, tokenizer, pol)
    prompt = list(prompt_tokens)
    kw = dict(max_tokens=max_tokens, temperature=0.0, **generate_kwargs)
    reference = plain.generate(prompt, **kw).tokens
    real = list(spec.drafters)
    outcomes = []
    for fault in chosen:
        faulty = _Faulty(next(d for d in real if d.name == name), fault, nth, prompt, reference)
        spec.drafters = [faulty if d.name == name else d for d in real]
        try:
            got = spec.generate(prompt, **kw).tokens
            error = None
        except ComponentError as exc:
            got, error = None, exc
        except Exception as exc:  # noqa: BLE001 - reported: the wrong kind of failure
            raise AssertionError(
                f"fault {fault!r} of drafter {name!r} ended in {type(exc).__name__}: {exc}, "
                "not a specdec.ComponentError naming the drafter"
            ) from exc
        finally:
            spec.drafters = real
        if not faulty.injected:
            raise AssertionError(
                f"fault {fault!r} was never injected: drafter {name!r} was asked to propose "
                f"fewer than {nth if fault == 'raise_nth' else 1} times in {max_tokens} "
                "tokens; use a prompt on which it drafts"
            )
        outcomes.append(_judge(fault, name, FAULTS[fault], got, error, reference))
        after = spec.generate(prompt, **kw).tokens
        assert after == reference, (
            f"after fault {fault!r} the pipeline's output differs from plain decoding:\n"
            f"  plain: {reference}\n  after: {after}"
        )
    return outcomes


def _judge(
    fault: str, name: str, expect: str, got: Any, error: Any, reference: list
) -> FaultOutcome:
    if expect == "identical":
        assert error is None, f"fault {fault!r} (drafting nothing) raised: {error}"
        assert got == reference, (
            f"fault {fault!r}: output differs from plain decoding:\n"
            f"  plain: {reference}\n  got:   {got}"
        )
        return FaultOutcome(fault, "identical")
    assert error is not None, (
        f"fault {fault!r} of drafter {name!r} raised no error; output {got} "
        f"(plain decoding: {reference})"
    )
    msg = str(error)
    assert repr(name) in msg and error.component == name, (
        f"fault {fault!r}: the error does not name drafter {name!r}: {msg}"
    )
    if expect == "draft":
        assert isinstance(error, DraftError), f"fault {fault!r}: not a DraftError: {msg}"
    else:
        cause = error.__cause__
        assert isinstance(cause, (InjectedFault, TypeError)), (
            f"fault {fault!r}: the error's cause is {cause!r}, not the exception raised"
        )
    return FaultOutcome(fault, "error", msg)
