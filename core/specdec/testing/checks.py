"""Assertions of the test kit: greedy identity, cache equality, distributions, forwards."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import random
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn

import mlx.core as mx
import numpy as np

from ..assembly import assemble
from ..plugins import PluginHost, get_plugin_host, reset_plugin_host
from ..policy import Policy
from ..presets import load_policy
from ..request import Request
from ..sampling import Sampler


def in_ci() -> bool:
    """Whether the tests run under CI: the environment variable ``CI`` is set (non-empty)."""
    return bool(os.environ.get("CI"))


def skip_unless_ci(reason: str) -> NoReturn:
    """Skip the calling test here; fail it under CI (``CI`` set), where a skip would hide ``reason``."""
    import pytest

    if in_ci():
        pytest.fail(f"{reason} (CI is set: this test must run there, not skip)", pytrace=False)
    pytest.skip(reason)


def require_installed(distribution: str) -> importlib.metadata.Distribution:
    """The installed ``distribution``; if it is not installed, skip the test here and fail it under CI.

    For a plugin's entry-point tests: run from a source tree without ``pip install``
    they skip, but a CI job where the plugin did not get installed fails.
    """
    try:
        return importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        skip_unless_ci(f"{distribution} is not installed")


def require_command(name: str) -> str:
    """The path of the console command ``name``; if it is not on ``PATH``, skip here and fail under CI."""
    exe = shutil.which(name)
    if exe is None:
        skip_unless_ci(f"the {name} command is not installed")
    return exe


@contextlib.contextmanager
def plugin_host(*plugins: Any, load_entry_points: bool = True) -> Iterator[PluginHost]:
    """A fresh plugin host with ``plugins`` registered by hand, installed process-wide for the block.

    Args:
        plugins: plugin modules or objects with ``@specdec.hookimpl`` functions
            (each registered under its ``__name__`` or class name, distribution ``"test"``).
        load_entry_points: also load installed plugins.
    """
    from .oracle import oracle_plugin

    host = PluginHost(load_entry_points=load_entry_points)
    for p in (oracle_plugin, *plugins):
        name = getattr(p, "__name__", None) or type(p).__name__
        if host.pm.is_registered(p) or name in {i.name for i in host.plugins}:
            continue
        host.register_plugin(p, name=name, distribution="test")
    previous = get_plugin_host() if _has_host() else None
    reset_plugin_host(host)
    try:
        yield host
    finally:
        reset_plugin_host(previous)


def _has_host() -> bool:
    from .. import plugins

    return plugins._host is not None


def _host_with_oracle(host: PluginHost | None = None) -> PluginHost:
    """``host`` (default: the process-wide one), with the kit's oracle drafter registered."""
    host = host or get_plugin_host()
    if "oracle" not in host.components["drafter"]:
        from .oracle import oracle_plugin

        host.register_plugin(oracle_plugin, name="specdec.testing.oracle", distribution="test")
    return host


def _plain(model: Any, tokenizer: Any = None, host: PluginHost | None = None) -> Any:
    """The plain path users get: ``assemble(model, tokenizer, "none")``."""
    return assemble(model, tokenizer, "none", host=_host_with_oracle(host))


def _pipes(model: Any, policy: Any, tokenizer: Any = None):
    """``(plain, spec)``: the plain pipeline users get and the one under ``policy``."""
    pol = load_policy(policy)
    return _plain(model, tokenizer), assemble(model, tokenizer, pol, host=_host_with_oracle())


def _require_drafts(drafted: int, accepted: int) -> None:
    assert drafted > 0, (
        "no tokens were drafted: speculation did not run (pass require_drafts=False "
        "if that is what the test means)"
    )
    assert accepted > 0, (
        f"{drafted} tokens drafted, none accepted (pass require_drafts=False "
        "if that is what the test means)"
    )


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_greedy_identity(
    model: Any,
    policy: Policy | str | dict,
    prompt_tokens: Sequence[int],
    *,
    max_tokens_list: Iterable[int] = range(1, 17),
    stop_tokens: Sequence[int] | None = None,
    tokenizer: Any = None,
    require_drafts: bool = True,
    **generate_kwargs: Any,
) -> dict:
    """Assert greedy output under ``policy`` equals plain decoding, for each ``max_tokens``, and with stop tokens.

    With ``stop_tokens=None`` a stop token is picked from the plain output (a
    token first seen at its middle) so a stop inside an accepted block is exercised.

    Returns:
        ``{"drafted", "accepted", "target_forwards", "plain_forwards", "runs"}`` summed over runs.

    Raises:
        AssertionError: on the first difference (with both streams), or if
            ``require_drafts`` and nothing was drafted and accepted.
    """
    plain, spec = _pipes(model, policy, tokenizer)
    prompt = list(prompt_tokens)
    totals = Counter()
    mts = list(max_tokens_list)
    for mt in mts:
        a = plain.generate(prompt, max_tokens=mt, temperature=0.0, **generate_kwargs)
        b = spec.generate(prompt, max_tokens=mt, temperature=0.0, **generate_kwargs)
        if a.tokens != b.tokens:
            i = _first_diff(a.tokens, b.tokens)
            raise AssertionError(
                f"greedy stream differs from plain decoding at token {i} (max_tokens={mt}):\n"
                f"  plain: {a.tokens}\n  spec:  {b.tokens}"
            )
        assert len(b.tokens) <= mt, f"max_tokens={mt} exceeded: {len(b.tokens)} tokens"
        assert a.finish_reason == b.finish_reason, (a.finish_reason, b.finish_reason)
        _add(totals, b.stats, a.stats)
    longest = plain.generate(
        prompt, max_tokens=max(mts + [16]), temperature=0.0, **generate_kwargs
    ).tokens
    if stop_tokens is None:
        seen: set = set()
        candidates = []
        for i, t in enumerate(longest):
            if t not in seen and i >= 1:
                candidates.append((abs(i - len(longest) // 2), i, t))
            seen.add(t)
        stop_tokens = [min(candidates)[2]] if candidates else []
    if stop_tokens:
        stops = list(stop_tokens)
        a = plain.generate(
            prompt, max_tokens=len(longest), temperature=0.0, stop_tokens=stops, **generate_kwargs
        )
        b = spec.generate(
            prompt, max_tokens=len(longest), temperature=0.0, stop_tokens=stops, **generate_kwargs
        )
        cut = next((i for i, t in enumerate(longest) if t in stops), None)
        if a.tokens != b.tokens:
            raise AssertionError(
                f"with stop tokens {stops} the stream differs from plain decoding:\n"
                f"  plain: {a.tokens}\n  spec:  {b.tokens}"
            )
        if cut is not None:
            assert b.finish_reason == "stop", (
                f"stop token inside the output did not end the stream: {b.finish_reason}"
            )
            # the stop token ends the stream and is not part of the output
            assert b.tokens == longest[:cut], (
                f"stream did not end at the stop token (index {cut}): {b.tokens}"
            )
        _add(totals, b.stats, a.stats)
    if require_drafts:
        _require_drafts(totals["drafted"], totals["accepted"])
    return dict(totals)


#: The largest gap between the two largest plain logits at which a batched row may
#: pick the other token of the near-tie (the rounding of another forward width).
BATCH_TIE_GAP = 1e-4


def check_batch_identity(
    model: Any,
    policy: Policy | str | dict,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int | Sequence[int] = 24,
    max_rows: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    tokenizer: Any = None,
    require_drafts: bool = True,
    against: str = "plain",
    **generate_kwargs: Any,
) -> dict:
    """Assert each row of a batched run under ``policy`` equals that prompt run alone
    with plain decoding (the ``none`` policy, :meth:`~specdec.Pipeline.generate`), or,
    with ``against="policy"``, with ``policy`` itself (sampled rows of a drafter with
    ``q``: rejection sampling keeps the target's distribution, not the plain run's
    tokens, so a row is compared with the same request decoded alone).

    ``max_tokens`` may give one value per prompt (rows then leave the batch at
    different rounds); ``max_rows`` below ``len(prompts)`` makes waiting prompts join
    as rows finish. Greedy rows may differ from plain decoding only at a near-tie: at
    the first difference the gap between the two largest plain logits must be at most
    :data:`BATCH_TIE_GAP` (the row is then not compared further); sampled rows
    (``temperature > 0``, position-keyed from ``seed``) must be identical.

    Returns:
        ``{"drafted", "accepted", "target_forwards", "plain_forwards", "runs",
        "max_batch_rows", "near_ties"}``; ``near_ties`` lists ``{"row", "position",
        "plain_top2_gap"}`` of the rows that took the other side of a near-tie.

    Raises:
        AssertionError: a row differs (position, gap and both streams in the message),
            the rows were never decoded together, or ``require_drafts`` and nothing was
            drafted and accepted.
    """
    from ..bench.runner import first_divergence

    if against not in ("plain", "policy"):
        raise ValueError(f"against must be 'plain' or 'policy', got {against!r}")
    plain, spec = _pipes(model, policy, tokenizer)
    prompts = [list(p) for p in prompts]
    mts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    assert len(mts) == len(prompts), "give one max_tokens per prompt"
    kw = dict(temperature=temperature, seed=seed, **generate_kwargs)
    ref_pipe = plain if against == "plain" else spec
    refs = [ref_pipe.generate(p, max_tokens=mt, **kw) for p, mt in zip(prompts, mts)]
    batch = spec.batch(len(prompts) if max_rows is None else max_rows)
    ids = {batch.add(p, max_tokens=mt, **kw): i for i, (p, mt) in enumerate(zip(prompts, mts))}
    got: list[list[int]] = [[] for _ in prompts]
    last: list[Any] = [None] * len(prompts)
    try:
        while len(batch):
            for ev in batch.step():
                if ev.error is not None:
                    raise AssertionError(f"row {ids[ev.row]} failed: {ev.error!r}") from ev.error
                i = ids[ev.row]
                if not ev.response.is_stop_token:
                    got[i].append(ev.response.token)
                last[i] = ev.response
    finally:
        batch.close()
    totals: Counter = Counter()
    ties = []
    widest = 0
    for i, (ref, toks, r) in enumerate(zip(refs, got, last)):
        if ref.tokens != toks:
            d = first_divergence(model, prompts[i], ref.tokens, toks)
            gap = d["plain_top2_gap"]
            if temperature > 0 or gap is None or gap > BATCH_TIE_GAP:
                raise AssertionError(
                    f"row {i} of the batch differs from the prompt run alone with {against} "
                    f"decoding at token {d['position']} (plain top-two logit gap there: "
                    f"{gap}):\n  {against}: {ref.tokens}\n  batch: {toks}"
                )
            ties.append({"row": i, "position": d["position"], "plain_top2_gap": gap})
        else:
            assert r.finish_reason == ref.finish_reason, (i, r.finish_reason, ref.finish_reason)
        _add(totals, r.stats, ref.stats)
        widest = max([widest, *r.stats.batch_rows])
    if len(prompts) > 1 and (max_rows is None or max_rows > 1):
        assert widest > 1, "the rows were never decoded together in one forward"
    if require_drafts:
        _require_drafts(totals["drafted"], totals["accepted"])
    return {**totals, "max_batch_rows": widest, "near_ties": ties}


def _add(totals: Counter, s: Any, plain: Any) -> None:
    totals["drafted"] += s.drafted
    totals["accepted"] += s.accepted
    totals["target_forwards"] += s.target_forwards
    totals["plain_forwards"] += plain.target_forwards
    totals["runs"] += 1


def cache_view(cache: Any) -> Any:
    """What the next query can see in ``cache``, as numpy arrays (temporal order)."""
    from mlx_lm.models import cache as C

    if hasattr(cache, "caches"):
        return tuple(cache_view(c) for c in cache.caches)
    t = type(cache)
    if t is C.RotatingKVCache:
        if cache.keys is None:
            return (cache.offset,)
        k, v = cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
        w = min(cache.offset, cache.max_size - 1)
        k, v = k[..., k.shape[2] - w :, :], v[..., v.shape[2] - w :, :]
        return (cache.offset, np.array(k), np.array(v))
    if t is C.KVCache:
        if cache.keys is None:
            return (cache.offset,)
        o = cache.offset
        return (o, np.array(cache.keys[..., :o, :]), np.array(cache.values[..., :o, :]))
    state = cache.state
    if not isinstance(state, (list, tuple)):
        state = [state]
    out = [getattr(cache, "offset", None)]
    for s in state:
        out.append(_numpy_tree(s))
    return tuple(out)


def _numpy_tree(s: Any) -> Any:
    """``s`` with every ``mx.array`` as numpy, also inside lists (``ArraysCache.state``)."""
    if isinstance(s, mx.array):
        return np.array(s)
    if isinstance(s, (list, tuple)):
        return tuple(_numpy_tree(x) for x in s)
    return s


def _compare_views(a: Any, b: Any, atol: float, where: str) -> float:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape, (
            f"{where}: shape {getattr(b, 'shape', b)} != {a.shape}"
        )
        d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
        assert d <= atol, f"{where}: max abs difference {d:.3g} > {atol}"
        return d
    if isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{where}: structure differs"
        return max(
            [_compare_views(x, y, atol, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
            + [0.0]
        )
    assert a == b, f"{where}: {b!r} != {a!r}"
    return 0.0


def check_caches_match_plain(
    model: Any,
    policy: Policy | str | dict,
    prompt_tokens: Sequence[int],
    *,
    max_tokens: int = 24,
    atol: float = 1e-4,
    tokenizer: Any = None,
    require_drafts: bool = True,
    **generate_kwargs: Any,
) -> float:
    """Assert that after every round the caches equal those of plain decoding of the same text.

    The reference caches are those of the ``none`` pipeline, recorded through
    ``on_round`` after each of its one-token rounds (with the hook it does not queue
    its next forward ahead); its stream is also checked against the same pipeline
    run without the hook, the plain path users get.

    Returns:
        the largest absolute difference seen.

    Raises:
        AssertionError: on a difference; if no round of the speculative run could be
            compared with the plain run (for instance when a stop token inside the first
            accepted block ends both runs); or, with ``require_drafts``, if nothing was
            drafted and accepted.
    """
    plain, spec = _pipes(model, policy, tokenizer)
    prompt = list(prompt_tokens)
    ref: dict[int, Any] = {}
    got: dict[int, Any] = {}

    def record(into: dict):
        def cb(result: Any, caches: list) -> None:
            n = result.start_position + len(result.committed)
            into[n] = [cache_view(c) for c in caches]

        return cb

    user = plain.generate(prompt, max_tokens=max_tokens, temperature=0.0, **generate_kwargs)
    a = plain.generate(
        prompt, max_tokens=max_tokens, temperature=0.0, on_round=record(ref), **generate_kwargs
    )
    b = spec.generate(
        prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        on_round=record(got),
        **generate_kwargs,
    )
    assert a.tokens == user.tokens, (
        f"the recorded plain run differs from plain decoding:\n"
        f"  plain:    {user.tokens}\n  recorded: {a.tokens}"
    )
    assert user.tokens == b.tokens, f"streams differ:\n  plain: {user.tokens}\n  spec:  {b.tokens}"
    if require_drafts:
        _require_drafts(b.stats.drafted, b.stats.accepted)
    worst = 0.0
    compared = [n for n in sorted(got) if n in ref]
    assert compared, (
        f"no round was compared: the speculative run's rounds ended at {sorted(got)} tokens, "
        f"the plain run's at {sorted(ref)}"
    )
    for n in compared:
        r_views, g_views = ref[n], got[n]
        assert len(r_views) == len(g_views), (
            f"after {n} tokens: {len(g_views)} caches, plain decoding has {len(r_views)}"
        )
        for layer, (r, g) in enumerate(zip(r_views, g_views)):
            worst = max(worst, _compare_views(r, g, atol, f"after {n} tokens, layer {layer}"))
    return worst


def _plain_next_logits(plain: Any, tokens: list[int]) -> mx.array:
    """The logits ``[1, V]`` the plain pipeline ``plain`` samples its first token from after ``tokens``."""
    seen: list = []

    def capture(history: mx.array, logits: mx.array) -> mx.array:
        seen.append(logits)
        return logits

    plain.generate(tokens, max_tokens=1, temperature=0.0, logits_processors=[capture])
    assert len(seen) == 1, f"the plain path computed next-token logits {len(seen)} times"
    return seen[0].reshape(1, -1)


def _exact_joint(
    model: Any,
    prompt: list[int],
    sampler: Sampler,
    depth: int,
    floor: float = 1e-6,
    tokenizer: Any = None,
    grammar: Any = None,
) -> dict:
    """The target's exact joint distribution of the next ``depth`` tokens (above ``floor``),
    from the logits of the plain path users get; with ``grammar``, each position's
    logits masked by the grammar's state after the tokens before it. A stop token (the
    tokenizer's EOS) ends a sequence early: it is counted under the tokens before it,
    as a stream reports them."""
    plain = _plain(model, tokenizer)
    out: dict[tuple, float] = {}
    g = plain.grammar_state(Request(grammar=grammar)) if grammar is not None else None
    stops = Request().stop_ids(tokenizer) if tokenizer is not None else frozenset()

    def rec(prefix: tuple, prob: float) -> None:
        if len(prefix) == depth or (prefix and prefix[-1] in stops):
            # a stop token ends the output there (and is not part of it)
            key = prefix[:-1] if prefix and prefix[-1] in stops else prefix
            out[key] = out.get(key, 0.0) + prob
            return
        logits = _plain_next_logits(plain, prompt + list(prefix))
        if g is not None:
            assert g.advance(prefix) == len(prefix), "a prefix the grammar forbids"
            logits = g.apply(logits.astype(mx.float32), first=len(prefix))
            g.undo()
        p = np.array(sampler.probs(logits.astype(mx.float32))[0])
        for t in np.nonzero(p * prob > floor)[0]:
            rec(prefix + (int(t),), prob * float(p[t]))

    rec((), 1.0)
    return out


def chi_square_p_value(
    observed: dict, expected_probs: dict, n: int, min_expected: float = 5.0
) -> float:
    """Chi-square goodness-of-fit p-value, pooling cells with expected count < ``min_expected``."""
    from scipy.stats import chi2

    cells_o, cells_e = [], []
    pool_o, pool_e = 0.0, 0.0
    keys = set(observed) | set(expected_probs)
    for k in keys:
        e = expected_probs.get(k, 0.0) * n
        o = observed.get(k, 0)
        if e >= min_expected:
            cells_o.append(o)
            cells_e.append(e)
        else:
            pool_o += o
            pool_e += e
    pool_e += max(0.0, n - sum(cells_e) - pool_e)  # mass below the enumeration floor
    if pool_e > 0:
        if pool_e < min_expected and cells_e:
            cells_o[-1] += pool_o
            cells_e[-1] += pool_e
        else:
            cells_o.append(pool_o)
            cells_e.append(pool_e)
    elif pool_o > 0:
        return 0.0
    stat = sum((o - e) ** 2 / e for o, e in zip(cells_o, cells_e))
    dof = max(1, len(cells_e) - 1)
    return float(chi2.sf(stat, dof))


def check_sampled_distribution(
    model: Any,
    policy: Policy | str | dict,
    prompt_tokens: Sequence[int],
    *,
    temperature: float = 1.0,
    max_tokens: int = 2,
    n_samples: int = 1500,
    alpha: float = 1e-3,
    tokenizer: Any = None,
    require_drafts: bool = True,
    grammar: Any = None,
    **sampler_kwargs: Any,
) -> float:
    """Assert the joint distribution of the first ``max_tokens`` sampled tokens is the target's (chi-square).

    With ``grammar`` (a request's ``grammar``) the requests are constrained and the
    reference is the target's distribution under the grammar's masks (its first
    ``max_tokens`` tokens must not finish the grammar).

    Returns:
        the p-value (asserted > ``alpha``).
    """
    _, spec = _pipes(model, policy, tokenizer)
    prompt = list(prompt_tokens)
    sampler = Sampler(temperature=temperature, seed=0, **sampler_kwargs)
    exact = _exact_joint(model, prompt, sampler, max_tokens, tokenizer=tokenizer, grammar=grammar)
    extra = {} if grammar is None else {"grammar": grammar}
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(n_samples):
        out = spec.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            seed=10_000 + seed,
            **sampler_kwargs,
            **extra,
        )
        counts[tuple(out.tokens)] += 1
        drafted += out.stats.drafted
        accepted += out.stats.accepted
    if require_drafts:
        _require_drafts(drafted, accepted)
    p = chi_square_p_value(counts, exact, n_samples)
    assert p > alpha, (
        f"sampled distribution differs from the target's: chi-square p={p:.3g} (alpha={alpha})"
    )
    return p


def check_sampled_identity(
    model: Any,
    policy: Policy | str | dict,
    prompt_tokens: Sequence[int],
    *,
    seeds: Iterable[int] = range(5),
    max_tokens: int = 16,
    temperature: float = 1.0,
    tokenizer: Any = None,
    require_drafts: bool = True,
    **sampler_kwargs: Any,
) -> dict:
    """Assert seeded sampled runs with deterministic drafts emit exactly the tokens of the seeded plain run.

    Returns:
        ``{"drafted", "accepted", "target_forwards", "plain_forwards", "runs"}`` summed over seeds.

    Raises:
        AssertionError: on the first difference, or if ``require_drafts`` and nothing
            was drafted and accepted over all seeds.
    """
    plain, spec = _pipes(model, policy, tokenizer)
    prompt = list(prompt_tokens)
    totals = Counter()
    for seed in seeds:
        a = plain.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, **sampler_kwargs
        )
        b = spec.generate(
            prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, **sampler_kwargs
        )
        if a.tokens != b.tokens:
            raise AssertionError(
                f"seeded sampled stream (seed={seed}) differs from plain seeded decoding at token "
                f"{_first_diff(a.tokens, b.tokens)}:\n  plain: {a.tokens}\n  spec:  {b.tokens}"
            )
        _add(totals, b.stats, a.stats)
    if require_drafts:
        _require_drafts(totals["drafted"], totals["accepted"])
    return dict(totals)


def check_fewer_forwards(
    model: Any,
    policy: Policy | str | dict,
    prompt_tokens: Sequence[int],
    *,
    max_tokens: int = 32,
    tokenizer: Any = None,
    require_drafts: bool = True,
    **generate_kwargs: Any,
) -> tuple[int, int]:
    """Assert ``policy`` needs fewer target forwards than plain decoding for the same output.

    Returns:
        ``(plain_forwards, spec_forwards)``.

    Raises:
        AssertionError: if the outputs differ, with ``require_drafts`` if nothing was
            drafted and accepted, or if there were not fewer forwards.
    """
    plain, spec = _pipes(model, policy, tokenizer)
    a = plain.generate(
        list(prompt_tokens), max_tokens=max_tokens, temperature=0.0, **generate_kwargs
    )
    b = spec.generate(
        list(prompt_tokens), max_tokens=max_tokens, temperature=0.0, **generate_kwargs
    )
    assert a.tokens == b.tokens, f"outputs differ:\n  plain: {a.tokens}\n  spec:  {b.tokens}"
    if require_drafts:
        _require_drafts(b.stats.drafted, b.stats.accepted)
    assert b.stats.target_forwards < a.stats.target_forwards, (
        f"no fewer target forwards: plain {a.stats.target_forwards}, spec {b.stats.target_forwards}"
    )
    return a.stats.target_forwards, b.stats.target_forwards


def plain_greedy(model: Any, prompt_tokens: Sequence[int], n: int) -> list[int]:
    """Plain greedy continuation of ``prompt_tokens`` (``n`` tokens) through the ``none`` policy."""
    return _plain(model).generate(list(prompt_tokens), max_tokens=n, temperature=0.0).tokens


def greedy_sequences(
    model: Any, n: int = 6, length: int = 56, *, seed: int = 0, prompt_len: int = 8, vocab: int = 64
) -> list[list[int]]:
    """``n`` training-style sequences: a random prompt of ``prompt_len`` ids below
    ``vocab``, then the model's own greedy continuation of ``length`` tokens (what a
    head trained for seconds on a tiny model learns to draft)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(vocab) for _ in range(prompt_len)]
        out.append(p + plain_greedy(model, p, length))
    return out


def check_listed(distribution: str, components: dict[str, list[str]]) -> None:
    """Assert that ``specdec plugins --json`` (the console command) lists ``distribution``
    with exactly ``components`` (``{role: [names]}``); skips in a source tree without the
    command or the distribution installed, fails under CI."""
    require_installed(distribution)
    exe = require_command("specdec")
    out = subprocess.run([exe, "plugins", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plugins = {p["distribution"]: p for p in json.loads(out.stdout)["plugins"]}
    assert distribution in plugins, sorted(plugins)
    assert plugins[distribution]["components"] == components, plugins[distribution]


def copy_heavy_prompt(model: Any, seed_tokens: Sequence[int], n: int = 24) -> list[int]:
    """A prompt whose continuation copies text it contains: seed, its greedy continuation, then the seed again."""
    cont = plain_greedy(model, seed_tokens, n)
    return list(seed_tokens) + cont + list(seed_tokens)


def find_copy_prompt(
    model: Any,
    policy: Any,
    *,
    min_accepted: int = 6,
    max_tokens: int = 32,
    seed_len: int = 10,
    cont_len: int = 40,
    tries: int = 16,
    drafter: str | None = None,
    tokenizer: Any = None,
    host: PluginHost | None = None,
) -> list[int]:
    """A prompt on which ``policy`` gets at least ``min_accepted`` drafts accepted and
    some rejected in ``max_tokens`` greedy tokens, searched for in a fixed order;
    ``drafter`` counts only that drafter's (of a policy with several).

    Candidate ``s`` (``0 .. tries - 1``) is ``seed_len`` tokens drawn with
    ``random.Random(s)`` below ``min(64, vocab_size)``, their greedy continuation
    (``cont_len`` tokens) and the seed again, as :func:`copy_heavy_prompt` builds it.
    On a tiny random model the continuation after the second seed need not repeat the
    first (it attends to all of it), so how many copy drafts a
    :func:`copy_heavy_prompt` gets accepted is luck; a test that needs accepted copies
    should search for its prompt with the policy and ``max_tokens`` it runs.

    Each candidate runs on a fresh pipeline (nothing one learns, such as a measured
    round overhead, carries over to the next), as the test's own pipeline will be.
    The pipelines are assembled with ``tokenizer`` (for a drafter that reads
    ``ctx.tokenizer`` or checks it in ``attach``; the candidates stay token ids) and
    resolve components from ``host`` (default: the process-wide host, which
    :func:`plugin_host` installs; pass one for a host built by hand), with the kit's
    oracle drafter added as the other checks add it.
    Which candidate qualifies can still depend on the machine where the policy sizes
    blocks by measured cost (a verify cost curve is profiled on the device).

    Raises:
        ValueError: ``drafter`` is not one of the policy's drafters.
        AssertionError: naming every candidate's (drafted, accepted), if none qualifies.
    """
    host = _host_with_oracle(host)
    pol = load_policy(policy, host=host)
    if drafter is not None and drafter not in pol.drafters:
        raise ValueError(
            f"find_copy_prompt: drafter {drafter!r} is not in policy {pol.name!r}, whose "
            f"drafters are {list(pol.drafters)}"
        )
    plain = _plain(model, tokenizer, host)
    vocab = min(64, int(getattr(getattr(model, "args", None), "vocab_size", 64) or 64))
    tried = []
    for s in range(tries):
        rng = random.Random(s)
        seed = [rng.randrange(vocab) for _ in range(seed_len)]
        cont = plain.generate(seed, max_tokens=cont_len, temperature=0.0).tokens
        prompt = seed + cont + seed
        spec = assemble(model, tokenizer, pol, host=host)
        stats = spec.generate(prompt, max_tokens=max_tokens, temperature=0.0).stats
        if drafter is None:
            drafted, accepted = stats.drafted, stats.accepted
        else:
            own = stats.per_drafter.get(drafter, {})
            drafted, accepted = own.get("drafted", 0), own.get("accepted", 0)
        if min_accepted <= accepted < drafted:
            return prompt
        tried.append((drafted, accepted))
    whose = f"{drafter}'s" if drafter else "its"
    raise AssertionError(
        f"no prompt of {tries} gets at least {min_accepted} of {whose} drafts accepted "
        f"and some rejected in {max_tokens} tokens: (drafted, accepted) {tried}"
    )


_ = math  # kept for users extending the kit
