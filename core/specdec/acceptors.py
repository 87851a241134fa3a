"""Built-in acceptors: greedy exact prefix, point-mass, and Leviathan rejection sampling.

``auto`` (chosen by the pipeline each round): greedy when the sampler is
greedy; point-mass when the draft is deterministic (no ``q``); rejection when
the drafter supplies draft probabilities ``q``.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from .roles import Acceptance
from .sampling import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_TOKEN, Sampler


def _first_mismatch(block: Sequence[int], targets: Sequence[int]) -> int:
    n = 0
    for d, t in zip(block, targets):
        if d != t:
            break
        n += 1
    return n


class GreedyAcceptor:
    """Keep the longest prefix of the block equal to the target's argmax; then the argmax token."""

    name = "greedy"

    def accept(self, block, draft_probs, logits, sampler, positions) -> Acceptance:
        """Exact-prefix acceptance (only valid for greedy sampling)."""
        targets = mx.argmax(logits, axis=-1).tolist()
        n = _first_mismatch(block, targets)
        return Acceptance(n_accepted=n, token=int(targets[n]))


class PointMassAcceptor:
    """Acceptance for deterministic drafts under sampling.

    A draft token ``d`` at position ``p`` is a point mass ``q = δ_d``; it is
    accepted with probability ``min(1, p(d)/q(d)) = p(d)`` and on rejection the
    correction is drawn from the residual ``norm(max(p - δ_d, 0))`` (``p`` with
    ``d`` removed). Both are realised at once by drawing ``x ~ p`` with the key
    of position ``p`` and accepting iff ``x == d``, so the emitted token at each
    position is the token plain seeded decoding would emit there.
    """

    name = "point_mass"

    def accept(self, block, draft_probs, logits, sampler: Sampler, positions) -> Acceptance:
        """Point-mass acceptance with residual correction (exact target distribution)."""
        draws = sampler.sample(logits, positions, STREAM_TOKEN)
        n = _first_mismatch(block, draws)
        return Acceptance(n_accepted=n, token=int(draws[n]))


class RejectionAcceptor:
    """Leviathan et al. speculative sampling: accept ``d ~ q`` with ``min(1, p(d)/q(d))``,
    otherwise draw from ``norm(max(p - q, 0))``; after a fully accepted block draw the bonus from ``p``.
    Deterministic drafts (``q`` is ``None``) are treated as point masses."""

    name = "rejection"

    def accept(self, block, draft_probs, logits, sampler: Sampler, positions) -> Acceptance:
        """Rejection sampling with residual correction (exact target distribution)."""
        k = len(block)
        if sampler.is_greedy:
            return GreedyAcceptor().accept(block, draft_probs, logits, sampler, positions)
        p = sampler.probs(logits)  # [k+1, V]
        if k:
            idx = mx.array(list(block))
            rows = mx.arange(k)
            p_d = p[rows, idx]
            if draft_probs is None:
                q_full = (mx.arange(p.shape[-1])[None, :] == idx[:, None]).astype(mx.float32)
            else:
                q_full = draft_probs.astype(mx.float32)
            q_d = q_full[rows, idx]
            p_d, q_d = p_d.tolist(), q_d.tolist()
            for i in range(k):
                u = sampler.uniform(positions[i], STREAM_ACCEPT)
                if q_d[i] > 0 and u * q_d[i] < p_d[i]:
                    continue
                residual = mx.maximum(p[i] - q_full[i], 0.0)
                total = residual.sum().item()
                if total <= 0:  # p == q exactly: any draw from p is correct
                    residual = p[i]
                tok = sampler.sample_scaled(
                    mx.log(residual)[None], [positions[i]], STREAM_RESIDUAL
                )[0]
                return Acceptance(n_accepted=i, token=int(tok))
        tok = sampler.sample(logits[k : k + 1], [positions[k]], STREAM_TOKEN)[0]
        return Acceptance(n_accepted=k, token=int(tok))


def auto_acceptor(sampler: Sampler, has_draft_probs: bool) -> str:
    """The acceptor name ``auto`` resolves to for this sampler and draft."""
    if sampler.is_greedy:
        return "greedy"
    return "rejection" if has_draft_probs else "point_mass"
