"""Per-request statistics."""

from __future__ import annotations

import attrs


@attrs.define
class Stats:
    """What happened in one request.

    Attributes:
        policy: the policy's name.
        prompt_tokens: prompt length in tokens.
        cached_tokens: prompt tokens a ``prompt_cache`` held already (not prefilled).
        generation_tokens: tokens emitted.
        target_forwards: rounds during decoding, each one target forward whose result was
            used, or two for a block fed on a round queued ahead (``lookahead_extended``);
            prefill excluded; rounds queued ahead and undone are ``lookahead_aborts``.
        drafted: draft tokens verified.
        accepted: draft tokens accepted.
        rounds_with_draft: rounds that verified a non-empty block.
        prompt_time_s / decode_time_s: wall time of prefill / of decoding.
        verify_time_s / commit_time_s: in rounds that verified a drafted block,
            time from the verify forward to the acceptance decision, and time to
            commit the caches (rollback) and settle them; rounds with nothing
            drafted and plain pipelined decoding add nothing to either.
        wait_time_s: host time spent waiting for the target, every round: queueing the
            verify forward (``mx.async_eval``, which returns only when most of a forward
            has run on the CPU) and reading its outcome back; the rest of
            ``decode_time_s`` (drafting included) is time outside the verify forward.
        peak_memory_gb: MLX peak memory during the request.
        per_drafter: ``{name: {"rounds", "drafted", "accepted", ...drafter stats}}``.
        speculation_off_reason: why speculation did not run, or ``None``.
        acceptors: how many rounds each acceptor decided.
        verifier: the verifier's name.
        rollbacks: names of the cache rollbacks in use.
        governor: the governor's ``stats()`` (empty without a governor).
        draft_heads: ``{head name: head.stats()}`` of the draft heads the drafters use.
        block_sizes: ``{k: rounds}``: how many rounds verified a block of ``k`` drafted
            tokens (0: a round that drafted nothing).
        shadow_proposals: rounds in which a drafter the governor gave no budget told what
            it would have proposed (shadow scoring).
        shadow_time_s: time spent asking for those proposals and scoring them (the
            governor's ``observe_round`` on rounds with shadows).
        lookahead_rounds: rounds that drafted nothing and had been queued ahead, as a
            plain step on the previous round's lazily sampled token (after two rounds in
            a row without a draft), so the host's work overlapped the forward.
        lookahead_extended: rounds in which a drafter proposed after a round had been
            queued ahead: only the block was fed, on top of the queued forward (which
            holds the last token and the logits that judge the first draft), in its
            transaction; such a round counts once in ``target_forwards``.
        lookahead_aborts: rounds queued ahead that were undone: the committed token was
            another, the stream ended, or their result could not be joined with a
            block's (a verifier's ``extras``). Their
            forwards ran but are not in ``target_forwards``, which counts the rounds
            whose forward was used.
        verify_cost: the pipeline's cost model's ``stats()`` (empty without one), at the
            end of the request: with ``round_overhead`` (the baseline and each
            drafter's extra in ms, the rounds seen by kind; :class:`specdec.costs.RoundOverhead`).
        distributed: on a model sharded across ranks (:mod:`specdec.distributed`):
            ``ranks``, ``rank``, ``kind``, ``method``, ``collectives_per_forward`` (this
            rank's collective operations per model forward), ``decode_forwards``,
            ``model_collectives`` (forwards times that), ``sync_collectives`` (the ranks'
            synchronisations: two per request, one per round, one at the end, two more
            per broadcast of draft probabilities), ``collectives`` (their sum),
            ``collectives_per_token`` (per generated token), ``prefill_collectives``,
            ``block_overrides`` (rounds in which this rank's drafter proposed another
            block than rank 0's, which every rank verified) and ``q_broadcasts``; empty
            otherwise.
        batch_rows: ``{rows: rounds}`` for a request decoded as a row of a batch: how
            many rounds ran with that many rows in the forward (empty when alone).
        batch_cut: drafted tokens of this row that its batch cut before verify, because
            the forward they widened did not pay for the batch's rows as a whole
            (:func:`specdec.costs.best_width`; blocks with acceptance estimates only).
        row_projection: with the ``hidden`` verifier's ``project = "rows"``: ``rounds``
            judged by projecting the target's logits one position at a time until the
            first rejection, ``rows`` projected, ``skipped`` (positions after a rejection,
            whose logits were never computed); empty otherwise.
        grammar: for a constrained request: its grammar's ``kind``, ``forced`` (tokens
            the grammar forced that were drafted and verified: they are also in
            ``drafted`` and ``accepted``, and in ``per_drafter["grammar"]``'s
            ``drafted`` / ``accepted``, whose ``rounds`` counts the rounds whose block
            was forced tokens alone), ``cut`` (drafted tokens the grammar forbade, cut before
            verify), ``mask_time_s`` (the grammar engine's time building masks and
            cutting blocks); empty otherwise.
        finish_reason: ``"stop"`` or ``"length"``.
    """

    policy: str = "none"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds_with_draft: int = 0
    prompt_time_s: float = 0.0
    decode_time_s: float = 0.0
    verify_time_s: float = 0.0
    commit_time_s: float = 0.0
    wait_time_s: float = 0.0
    peak_memory_gb: float = 0.0
    per_drafter: dict = attrs.field(factory=dict)
    speculation_off_reason: str | None = None
    acceptors: dict = attrs.field(factory=dict)
    verifier: str = "logits"
    rollbacks: list = attrs.field(factory=list)
    governor: dict = attrs.field(factory=dict)
    draft_heads: dict = attrs.field(factory=dict)
    block_sizes: dict = attrs.field(factory=dict)
    shadow_proposals: int = 0
    shadow_time_s: float = 0.0
    lookahead_rounds: int = 0
    lookahead_extended: int = 0
    lookahead_aborts: int = 0
    verify_cost: dict = attrs.field(factory=dict)
    distributed: dict = attrs.field(factory=dict)
    batch_rows: dict = attrs.field(factory=dict)
    batch_cut: int = 0
    row_projection: dict = attrs.field(factory=dict)
    grammar: dict = attrs.field(factory=dict)
    finish_reason: str | None = None

    @property
    def tokens_per_forward(self) -> float:
        """Emitted tokens per target forward."""
        return self.generation_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def rollback_fraction(self) -> float:
        """Commit (rollback) time as a fraction of verify time, over rounds with a drafted block."""
        return self.commit_time_s / self.verify_time_s if self.verify_time_s > 0 else 0.0

    @property
    def loop_overhead_s(self) -> float:
        """Host time per round outside waiting for the target: ``(decode - wait) / forwards``."""
        if not self.target_forwards:
            return 0.0
        return max(0.0, self.decode_time_s - self.wait_time_s) / self.target_forwards

    @property
    def rounds_without_draft(self) -> int:
        """Rounds that verified no drafted token."""
        return self.target_forwards - self.rounds_with_draft

    @property
    def shadow_fraction(self) -> float:
        """Shadow-scoring time over decode time."""
        return self.shadow_time_s / self.decode_time_s if self.decode_time_s > 0 else 0.0

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens prefilled (those a ``prompt_cache`` held left out) per second."""
        fed = self.prompt_tokens - self.cached_tokens
        return fed / self.prompt_time_s if self.prompt_time_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second of decoding (prefill excluded)."""
        return self.generation_tokens / self.decode_time_s if self.decode_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        """A JSON-able dict with the derived rates included."""
        d = attrs.asdict(self)
        d.update(
            tokens_per_forward=self.tokens_per_forward,
            acceptance_rate=self.acceptance_rate,
            rollback_fraction=self.rollback_fraction,
            loop_overhead_s=self.loop_overhead_s,
            rounds_without_draft=self.rounds_without_draft,
            shadow_fraction=self.shadow_fraction,
            prompt_tps=self.prompt_tps,
            decode_tps=self.decode_tps,
        )
        return d

    def summary(self) -> str:
        """One line: decode tok/s, tokens per forward, acceptance."""
        s = (
            f"decode {self.decode_tps:.1f} tok/s, prompt {self.prompt_tps:.1f} tok/s, "
            f"{self.generation_tokens} tokens in {self.target_forwards} forwards "
            f"({self.tokens_per_forward:.2f} tok/forward), "
            f"acceptance {self.acceptance_rate:.0%} ({self.accepted}/{self.drafted}), "
            f"peak {self.peak_memory_gb:.2f} GB"
        )
        if self.batch_rows:
            rounds = sum(self.batch_rows.values())
            mean = sum(b * n for b, n in self.batch_rows.items()) / rounds
            s += f", in a batch of {mean:.1f} rows on average"
        if self.distributed:
            d = self.distributed
            s += f", {d['ranks']} ranks, {d['collectives_per_token']:.1f} collectives/token"
        if self.speculation_off_reason:
            s += f", speculation off: {self.speculation_off_reason}"
        return s
