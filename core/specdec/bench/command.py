"""``specdec bench``: the command line over :func:`specdec.bench.run_bench`.

Every bad argument is reported before the model is loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

from ..cli.common import (
    EXIT_OK,
    CliError,
    check_model_spec,
    check_policy_components,
    default_model,
    print_json,
)
from ..distributed import SHARDING_KINDS
from .plot import MATPLOTLIB_MISSING, matplotlib_available, plot_results
from .progress import Progress
from .runner import (
    BASELINES,
    SHORT_ANSWER_TOKENS,
    distributed_table,
    exactness_table,
    grammar_table,
    policy_pairs,
    policy_pairs_table,
    rounds_table,
    run_bench,
    single_comparison_table,
    spec_baseline_table,
    sweep_policies,
    total_steps,
)
from .workloads import get_workloads, workload_names

DEFAULT_RUNS = 3
DEFAULT_MAX_TOKENS = 300
DEFAULT_SEED = 0
DEFAULT_BENCH_POLICY = "copy"


#: What ``--dtype`` casts to.
DTYPES = ("float32", "bfloat16", "float16")


def add_bench_parser(sub: Any, func: Any) -> None:
    """Add the ``bench`` subcommand to ``sub`` (an argparse subparsers object)."""
    names = ", ".join(workload_names())
    p = sub.add_parser(
        "bench",
        help="benchmark a speculative policy against plain decoding",
        description=(
            "Run the shipped workloads with the 'none' policy (off) and a speculative "
            "policy (on), interleaved, and report median decode tok/s (prompt processing "
            "excluded), the on/off ratio, tokens per target forward, acceptance, whether "
            "every run was token-identical to plain decoding, peak memory, cache commit "
            "(rollback) time over verify time, and how faithful the output is to the "
            f"expected answer. Workloads: {names}."
        ),
    )
    p.add_argument(
        "--model",
        default=None,
        help="local model folder or Hugging Face id (default: the built-in default model)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=None,
        help="a policy measured against 'none': a preset or a .toml file; repeat it to "
        "measure several policies side by side against the same 'none' runs "
        f"(default: {DEFAULT_BENCH_POLICY})",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help=(
            "build the --model folder's config.json with random weights (a folder with no "
            "*.safetensors; without tokenizer files it gets a byte tokenizer): measures "
            "identity, tokens per forward and commit cost on an architecture, not speed-ups"
        ),
    )
    p.add_argument(
        "--sweep",
        default=None,
        metavar="COMPONENT.OPTION=V1,V2,...",
        help=(
            "measure one variant of --policy per value of a component option against the "
            "same 'none' runs, e.g. gdn_transaction.strategy=capture,tape,rerun"
        ),
    )
    p.add_argument(
        "--workload",
        "-w",
        action="append",
        default=None,
        metavar="NAME",
        help=f"a workload to run, repeatable (default: all of {names})",
    )
    p.add_argument(
        "--runs",
        type=int,
        default=DEFAULT_RUNS,
        help=f"measured runs of each contender per workload (default: {DEFAULT_RUNS})",
    )
    p.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"tokens generated per run (default: {DEFAULT_MAX_TOKENS})",
    )
    p.add_argument(
        "--temp",
        type=float,
        action="append",
        default=None,
        help="sampling temperature, repeatable for one record set per temperature (default: 0)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=DEFAULT_SEED,
        help=f"the sampling seed of every run, and the weights' seed with --random-weights (default: {DEFAULT_SEED})",
    )
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        default=None,
        help="also time mlx-lm's own stream_generate and compare the 'none' policy with it",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print the records as a JSON list on stdout (the table goes to stderr)",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw off/on tok/s and tokens per forward per workload (needs matplotlib)",
    )
    p.add_argument(
        "--details",
        default=None,
        metavar="FILE.json",
        help="write everything measured (every run, outputs, faithfulness, baseline) to a JSON file",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="cast the model's weights to this dtype before measuring (default: as loaded); "
        "the exactness table then reports, for every greedy run, whether it matched plain "
        "decoding and, where not, the position and the gap between the top two plain logits",
    )
    p.add_argument(
        "--batch",
        default=None,
        metavar="B1,B2,...",
        help="measure batched decoding instead: each workload's prompt as B rows at every "
        "batch size given, aggregate decode tok/s of the policy vs 'none' vs mlx-lm's "
        "batch_generate (greedy; with --workload, --runs, --max-tokens, --json)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="measure on the model sharded across the ranks of this distributed job "
        "(run under mlx.launch, e.g. mlx.launch --backend ring -n 2 --hosts 127.0.0.1 "
        "specdec bench --distributed ...): tensor parallel, every rank runs every request, "
        "rank 0 prints; adds collectives per generated token off and on",
    )
    p.add_argument(
        "--sharding",
        choices=SHARDING_KINDS,
        default="auto",
        help="with --distributed: tensor parallel, pipeline parallel, or auto (tensor where "
        "the model allows it, else pipeline; default)",
    )
    p.add_argument(
        "--compare-single",
        action="store_true",
        help="with --distributed: after the sharded runs, rank 0 runs the same workloads on "
        "the whole model alone while the other ranks wait idle (every rank on one host), "
        "and the ratios are printed side by side",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=func)


def _parse_batches(spec: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        raise CliError(
            f"--batch takes batch sizes >= 1 separated by commas (e.g. 1,2,4,8), got {spec!r}"
        )
    return list(dict.fromkeys(out))


def _check_sweep_component(name: str, policy: Any) -> None:
    """The swept component must be installed and used by the policy.

    Used means: one of its drafters, its governor, verifier or acceptor, or a cache
    rollback (with ``rollback = "auto"`` any installed rollback may serve a cache;
    the bench warns afterwards when the swept one served none).
    """
    import specdec

    host = specdec.get_plugin_host()
    known = sorted({n for comps in host.components.values() for n in comps})
    if name not in known:
        raise CliError(
            f"--sweep: no installed component is named {name!r}; installed components: "
            f"{', '.join(known)} (see 'specdec plugins')"
        )
    used = {*policy.drafters, policy.governor, policy.verifier, policy.acceptor}
    rollbacks = set(host.components.get("cache_rollback", {}))
    if name not in used and name not in rollbacks:
        in_policy = sorted(n for n in used if n and n != "auto")
        raise CliError(
            f"--sweep: policy {policy.name!r} does not use {name!r}, so its option would "
            f"change nothing; sweep one of {', '.join(in_policy + sorted(rollbacks))}"
        )


def _warn_unused_rollback(name: str, results: list) -> None:
    """A swept cache rollback that served no cache changed nothing: say so."""
    import specdec

    if name not in specdec.get_plugin_host().components.get("cache_rollback", {}):
        return
    used = {rb.split(":", 1)[0] for res in results for s in res.on for rb in (s.rollbacks or [])}
    if name not in used:
        print(
            f"specdec bench: warning: cache rollback {name!r} served no cache of this model "
            f"(rollbacks in use: {', '.join(sorted(used)) or 'none'}); the swept variants "
            "differ in nothing",
            file=sys.stderr,
            flush=True,
        )


def _check_output_path(path: str, flag: str) -> str:
    path = os.path.expanduser(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CliError(f"{flag} {path!r} is a folder; give a file name")
    if not os.path.isdir(parent):
        raise CliError(f"{flag} {path!r}: folder {parent!r} does not exist")
    return path


def _fmt_ratio(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def format_table(results: list, *, baseline: str | None = None) -> str:
    """The results as a Markdown table (and a baseline table when there is one)."""
    head = (
        "| workload | temp | off tok/s | on tok/s | ratio | tokens/forward | acceptance "
        "| identical | peak off GB | peak on GB | commit/verify | faithful |"
    )
    if len({r.policy for r in results}) > 1:
        head = head.replace("| temp |", "| temp | policy |", 1)
    lines = [head, "|" + "---|" * head.count(" |")]
    for res in results:
        r = res.record()
        faith = "n/a" if res.faithfulness is None else f"{100 * res.faithfulness:.0f}%"
        pol = f" {r['policy']} |" if "| policy |" in head else ""
        lines.append(
            f"| {r['workload']} | {r['temp']:g} |{pol} {r['off_tps']:.1f} | {r['on_tps']:.1f} "
            f"| {r['ratio']:.2f}x | {r['tokens_per_forward']:.2f} "
            f"| {100 * r['acceptance_rate']:.0f}% | {'yes' if r['identical'] else 'NO'} "
            f"| {r['off_peak_gb']:.3f} | {r['on_peak_gb']:.3f} "
            f"| {100 * res.commit_fraction:.1f}% | {faith} |"
        )
    short = {(r.workload, r.temp): r.off[0] for r in results if r.short_answer}
    if short:
        each = ", ".join(
            f"{w} at temp {t:g} ({len(s.tokens)} tokens)" for (w, t), s in short.items()
        )
        cut = any(s.finish_reason == "length" for s in short.values())
        ended = any(s.finish_reason != "length" and t > 0 for (_, t), s in short.items())
        advice = [
            *(["raise --max-tokens"] if cut else []),
            *(["try another --seed for a sampled answer that ended early"] if ended else []),
        ]
        lines += [
            "",
            f"Too short to time: {each}. An answer under {SHORT_ANSWER_TOKENS} tokens "
            "decodes in about a second, so its ratio is mostly noise"
            + (f" ({'; '.join(advice)})." if advice else "."),
        ]
    if baseline:
        lines += [
            "",
            f"| workload | temp | none tok/s | {baseline} tok/s | none / {baseline} | same tokens |",
            "|---|---|---|---|---|---|",
        ]
        seen = set()
        for res in results:
            if (res.workload, res.temp) in seen or not res.baseline:
                continue  # policies of a sweep share the baseline; a grammar has none
            seen.add((res.workload, res.temp))
            d = res.details()
            same = d["baseline_identical"]
            lines.append(
                f"| {res.workload} | {res.temp:g} | {d['off_step_tps']:.1f} "
                f"| {d['baseline_tps']:.1f} | {_fmt_ratio(d['none_vs_baseline'])} "
                f"| {'n/a (sampled)' if same is None else ('yes' if same else 'no')} |"
            )
    constrained = grammar_table(results)
    if constrained:
        lines += ["", "constrained decoding (mlx-lm has none: no peer runs):", constrained]
    spec = spec_baseline_table(results)
    if spec:
        lines += ["", spec]
    pairs = policy_pairs_table(results)
    if pairs:
        lines += ["", pairs]
    rounds = rounds_table(results)
    if rounds:
        lines += ["", rounds]
    return "\n".join(lines)


def _emit(text: str, out: TextIO) -> None:
    out.write(text + "\n")
    out.flush()


def cmd_bench(args: argparse.Namespace) -> int:
    import specdec

    # 1. everything that can be checked without a model
    if args.runs < 1:
        raise CliError(f"--runs must be >= 1, got {args.runs}")
    if args.max_tokens < 1:
        raise CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    temps = args.temp if args.temp else [0.0]
    for t in temps:
        if not t >= 0:  # also NaN
            raise CliError(f"--temp must be >= 0, got {t}")
    temps = list(dict.fromkeys(float(t) for t in temps))
    workloads = get_workloads(args.workload)
    policies = [specdec.load_policy(p) for p in (args.policy or [DEFAULT_BENCH_POLICY])]
    for pol in policies:
        check_policy_components(pol)
    names = [pol.name for pol in policies]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise CliError(
            f"--policy: each measured policy needs its own name; {', '.join(dupes)} is given "
            "more than once (set name = ... in a policy file)"
        )
    policy = policies[0]
    swept = None  # the swept component's name
    if args.sweep is not None:
        if len(policies) > 1:
            raise CliError("--sweep measures variants of one policy: give one --policy with it")
        policies = sweep_policies(policy, args.sweep)
        swept = args.sweep.partition(".")[0]
        _check_sweep_component(swept, policy)
    if args.plot is not None:
        args.plot = _check_output_path(args.plot, "--plot")
        if not matplotlib_available():
            raise CliError(MATPLOTLIB_MISSING)
    if args.details is not None:
        args.details = _check_output_path(args.details, "--details")
    batches = None
    if args.batch is not None:
        batches = _parse_batches(args.batch)
        unusable = [
            flag
            for flag, on in (
                ("--baseline", args.baseline is not None),
                ("--plot", args.plot is not None),
                ("--details", args.details is not None),
                ("--dtype", args.dtype is not None),
                ("--temp", temps != [0.0]),
            )
            if on
        ]
        if unusable:
            raise CliError(
                f"--batch measures greedy batched decoding; it does not take {', '.join(unusable)}"
            )
        from ..composition import check_batch

        try:
            for pol in policies:
                check_batch(specdec.get_plugin_host(), pol, max(batches))
        except specdec.PolicyError as exc:
            raise CliError(f"--batch: {exc}") from exc
    world = None
    if args.compare_single and not args.distributed:
        raise CliError("--compare-single goes with --distributed")
    if args.sharding != "auto" and not args.distributed:
        raise CliError("--sharding goes with --distributed")
    if args.distributed:
        if batches is not None:
            raise CliError(
                "--distributed does not take --batch (batched decoding of a sharded "
                "model is not supported yet)"
            )
        from ..distributed import launched_world

        world = launched_world()
        if world is None:
            raise CliError(
                "--distributed measures a model sharded across the ranks of a distributed job, "
                "but this process is not one of several ranks: run it under mlx.launch, e.g. "
                "mlx.launch --backend ring -n 2 --hosts 127.0.0.1 specdec bench --distributed"
            )
    model_spec = check_model_spec(args.model, "--model") if args.model else None
    if args.random_weights and model_spec is None:
        raise CliError("--random-weights needs --model FOLDER (a folder with a config.json)")
    if model_spec is None:
        model_spec = default_model()
    from ..loading import check_model_path, load_model

    check_model_path(model_spec, random_weights=args.random_weights)

    # 2. the model, once
    try:
        model, tokenizer = load_model(
            model_spec, random_weights=args.random_weights, seed=args.seed, lazy=world is not None
        )
    except specdec.SpecdecError:
        raise
    except (OSError, ValueError) as exc:  # pragma: no cover - load_model wraps these
        raise CliError(f"cannot load model {model_spec!r}: {exc}") from exc
    speaks = True  # rank 0 of a distributed job, or a single process
    sharding = None
    if world is not None:
        from ..distributed import shard_model

        sharding = shard_model(model, world, args.sharding)
        speaks = sharding.rank == 0
    if args.dtype is not None:
        import mlx.core as mx

        model.set_dtype(getattr(mx, args.dtype))

    if batches is not None:
        return _batch_bench(args, model, tokenizer, model_spec, workloads, policies, batches)

    from ..attention import status as attention_status

    attention = attention_status()
    measured = ", ".join(p.name for p in policies)
    header = (
        f"specdec bench: model {model_spec}"
        + (f" (random weights, seed {args.seed})" if args.random_weights else "")
        + (f" cast to {args.dtype}" if args.dtype else "")
        + (
            f", sharded across {sharding.ranks} ranks ({sharding.kind}, {sharding.method}, "
            f"{sharding.collectives_per_forward} collectives per forward)"
            if sharding is not None
            else ""
        )
        + f", policy {measured} vs none, "
        f"{args.runs} run(s) each, {args.max_tokens} tokens, temp {', '.join(f'{t:g}' for t in temps)}, "
        f"seed {args.seed}"
        + (f", baseline {args.baseline}" if args.baseline else "")
        + f"; verify attention: {attention.describe()}"
    )
    if speaks:
        print(header, file=sys.stderr, flush=True)
    results = _measure(args, model, tokenizer, workloads, policies, temps, show=speaks)

    single = None
    if args.compare_single:
        single = _single_runs(args, world, model_spec, tokenizer, workloads, policies, temps)
    if not speaks:
        return EXIT_OK
    if swept is not None:
        _warn_unused_rollback(swept, results)
    table = format_table(results, baseline=args.baseline)
    exact = exactness_table(results, always=args.dtype is not None)
    if exact:
        table += "\n\n" + exact
    if sharding is not None:
        table += "\n\n" + distributed_table(results, sharding.ranks)
    if single is not None:
        table += "\n\n" + single_comparison_table(results, single, sharding.ranks)
    if args.json:
        print_json([r.record() for r in results])
        _emit(table, sys.stderr)
    else:
        _emit(table, sys.stdout)
    if args.details is not None:
        doc = {
            "model": str(model_spec),
            "policy": policy.name,
            "policies": [p.name for p in policies],
            "random_weights": args.random_weights,
            "runs": args.runs,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "baseline": args.baseline,
            "dtype": args.dtype,
            "verify_attention": {"replica": attention.enabled, "reason": attention.reason},
            "results": [r.details(with_output=True) for r in results],
            "policy_pairs": policy_pairs(results),
        }
        with open(args.details, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
    if args.plot is not None:
        plot_results(
            results, args.plot, title=f"specdec bench: {os.path.basename(str(model_spec))}"
        )
        print(f"specdec bench: plot written to {args.plot}", file=sys.stderr, flush=True)
    return EXIT_OK


def _measure(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    workloads: list,
    policies: list,
    temps: list,
    *,
    show: bool,
    baseline: Any = ...,
    prefix: str = "specdec bench",
) -> list:
    """:func:`run_bench` with the command's arguments and a progress bar (drawn when
    ``show``); ``baseline`` defaults to ``--baseline``."""
    baseline = args.baseline if baseline is ... else baseline
    steps = total_steps(
        len(workloads), len(temps), args.runs, baseline is not None, n_policies=len(policies)
    )
    progress = Progress(steps, sys.stderr, enabled=show and not args.no_progress, prefix=prefix)
    try:
        return run_bench(
            model,
            tokenizer,
            workloads,
            policies=policies,
            runs=args.runs,
            temps=temps,
            max_tokens=args.max_tokens,
            seed=args.seed,
            baseline=baseline,
            score_faithfulness=not args.random_weights,
            progress=progress,
        )
    finally:
        progress.close()


def _single_runs(
    args: argparse.Namespace,
    world: Any,
    model_spec: Any,
    tokenizer: Any,
    workloads: list,
    policies: list,
    temps: list,
) -> list | None:
    """``--compare-single``: rank 0 runs the workloads on the whole model alone while the
    other ranks wait idle, polling a file (a rank blocked in a collective spins a core);
    returns rank 0's results (``None`` on the other ranks)."""
    import socket
    import tempfile
    import time
    import zlib
    from pathlib import Path

    import mlx.core as mx
    import numpy as np

    from ..loading import load_model

    nonce = int.from_bytes(os.urandom(3), "little")
    me = [zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF, os.getpid(), nonce]
    info = np.array(mx.distributed.all_gather(mx.array(me, dtype=mx.int32), group=world))
    info = info.reshape(world.size(), 3)
    if len({int(h) for h in info[:, 0]}) > 1:
        raise CliError("--compare-single needs every rank on one host (the others wait idle)")
    # rank 0's pid and a fresh nonce: a marker left by an earlier run is never read
    marker = (
        Path(tempfile.gettempdir()) / f"specdec-bench-single-{int(info[0, 1])}-{int(info[0, 2])}"
    )

    def say(word: str) -> None:  # written whole: a polling rank never reads half a word
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(word)
        os.replace(tmp, marker)

    out = None
    if world.rank() == 0:
        try:
            model, _ = load_model(model_spec, random_weights=args.random_weights, seed=args.seed)
            if args.dtype is not None:
                model.set_dtype(getattr(mx, args.dtype))
            out = _measure(
                args,
                model,
                tokenizer,
                workloads,
                policies,
                temps,
                show=True,
                baseline=None,
                prefix="specdec bench (single process)",
            )
            say("ok")
        except BaseException:
            say("failed")
            raise
    else:
        while not marker.exists():
            time.sleep(0.2)
        if marker.read_text() != "ok":
            marker.unlink(missing_ok=True)
            raise CliError("--compare-single: rank 0's single-process runs failed (see its error)")
    mx.eval(mx.distributed.all_sum(mx.array([1.0]), group=world))  # everyone saw the marker
    if world.rank() == 0:
        marker.unlink(missing_ok=True)
    return out


def _batch_bench(
    args: argparse.Namespace,
    model: Any,
    tokenizer: Any,
    model_spec: Any,
    workloads: list,
    policies: list,
    batches: list[int],
) -> int:
    from .batch import batch_steps, batch_table, run_batch_bench

    progress = Progress(
        batch_steps(len(workloads), batches, args.runs, len(policies)),
        sys.stderr,
        enabled=not args.no_progress,
    )
    names = ", ".join(p.name for p in policies)
    print(
        f"specdec bench --batch: model {model_spec}, policy {names} vs none vs mlx-lm "
        f"batch_generate, batch sizes {', '.join(map(str, batches))}, {args.runs} run(s) each, "
        f"{args.max_tokens} tokens, greedy",
        file=sys.stderr,
        flush=True,
    )
    try:
        results = run_batch_bench(
            model,
            tokenizer,
            workloads,
            policy=policies,
            batches=batches,
            runs=args.runs,
            max_tokens=args.max_tokens,
            progress=progress,
        )
    finally:
        progress.close()
    table = batch_table(results)
    if args.json:
        print_json([r.record() for r in results])
        _emit(table, sys.stderr)
    else:
        _emit(table, sys.stdout)
    return EXIT_OK
