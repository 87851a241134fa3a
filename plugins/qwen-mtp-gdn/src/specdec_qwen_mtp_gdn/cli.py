"""``specdec train-head``: give a model an MTP head (added to the ``specdec`` command
through the ``specdec_register_commands`` hook)."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

import specdec

#: What the output folder holds besides the head's checkpoint.
STATE_FILE = "train_state.json"
DATA_FILE = "train_data.json"
SUMMARY_FILE = "train_head.json"


class TrainHeadError(specdec.SpecdecError, ValueError):
    """Bad ``train-head`` input (the message names it and what would be accepted)."""


def shipped_prompts() -> list[str]:
    """The prompts shipped for self-distillation (``data/train_prompts.txt``; none is a
    bench workload)."""
    text = resources.files(__package__).joinpath("data/train_prompts.txt").read_text("utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def add_train_head_parser(sub: Any) -> None:
    """Add ``train-head`` to the ``specdec`` command's subparsers."""
    p = sub.add_parser(
        "train-head",
        help="train an MTP head for a model on its own answers (for the qwen_mtp drafter)",
        description=(
            "Self-distil a multi-token-prediction head for MODEL: from the target's hidden "
            "state at t and the token at t+1 it learns the target's distribution over the "
            "token at t+2, the way qwen_mtp drafts with it. The model answers the shipped "
            "prompts (or --prompts, --text windows), and those answers are the training "
            "text; a tenth is held out to measure how often the head's first draft would "
            "be accepted. The target stays frozen. The head goes to --out as a checkpoint "
            "in the Hugging Face layout (mtp.* tensors, config.json with the target's "
            "identity), saved every --save-every steps; --resume continues from there."
        ),
    )
    p.add_argument(
        "--model", default=None, help="model folder (default: the built-in default model)"
    )
    p.add_argument("--out", required=True, help="folder to write the head to")
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts for the model to answer, one per line (default: the shipped ones)",
    )
    p.add_argument(
        "--text",
        action="append",
        default=[],
        metavar="FILE",
        help="also train on windows of this UTF-8 text, each continued by the model (repeatable)",
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all (default: 300)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default: 1e-3)")
    p.add_argument("--layers", type=int, default=1, help="MTP decoder layers (default: 1)")
    p.add_argument(
        "--max-sequences",
        type=int,
        default=200,
        help="prompts and --text windows in all, held out ones too (default: 200)",
    )
    p.add_argument(
        "--continue",
        dest="continue_tokens",
        type=int,
        default=128,
        help="tokens the model writes per prompt or window (default: 128)",
    )
    p.add_argument(
        "--seq-len", type=int, default=128, help="tokens per --text window (default: 128)"
    )
    p.add_argument(
        "--held-out",
        type=float,
        default=0.1,
        help="fraction of the prompts held out, with all their answers (default: 0.1)",
    )
    p.add_argument(
        "--answers",
        type=int,
        default=4,
        help="answers the model writes per prompt or window: the first greedy, the others "
        "sampled at --sample-temp (default: 4)",
    )
    p.add_argument(
        "--sample-temp",
        type=float,
        default=0.8,
        help="the temperature of the sampled answers (default: 0.8)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="sequences per optimizer step (default: 8)"
    )
    p.add_argument(
        "--loss",
        choices=("auto", "sampled", "full"),
        default="auto",
        help="sampled: KL over a candidate set plus the whole vocabulary's logit error "
        "through the output layer's Gram matrix (cheap); full: KL over the whole "
        "vocabulary; auto: sampled where the output layer is affine (default: auto)",
    )
    p.add_argument(
        "--candidates",
        type=int,
        default=8,
        help="the target's most likely tokens per position in the sampled loss's "
        "candidate set (default: 8)",
    )
    p.add_argument(
        "--negatives",
        type=int,
        default=1024,
        help="tokens drawn uniformly into the candidate set every step (default: 1024)",
    )
    p.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="stop training after this many minutes (the data's generation not counted) "
        "and save the head (default: no limit)",
    )
    p.add_argument(
        "--save-every", type=int, default=50, help="checkpoint interval in steps (default: 50)"
    )
    p.add_argument("--resume", action="store_true", help="continue the training saved in --out")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the initialisation, the minibatch order, the sampled answers and "
        "the negatives (default: 0)",
    )
    p.add_argument("--force", action="store_true", help="start afresh in a non-empty --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_train_head)


def _check(args: argparse.Namespace) -> Path:
    for name, lo in (
        ("steps", 1),
        ("layers", 1),
        ("seq_len", 3),
        ("max_sequences", 2),
        ("continue_tokens", 1),
        ("save_every", 1),
        ("answers", 1),
        ("batch_size", 1),
        ("candidates", 1),
        ("negatives", 0),
    ):
        v = getattr(args, name)
        if v < lo:
            flag = "--continue" if name == "continue_tokens" else f"--{name.replace('_', '-')}"
            raise TrainHeadError(f"{flag} must be >= {lo}, got {v}")
    if not args.lr > 0:
        raise TrainHeadError(f"--lr must be > 0, got {args.lr}")
    if not args.sample_temp > 0:
        raise TrainHeadError(f"--sample-temp must be > 0, got {args.sample_temp}")
    if args.minutes is not None and not args.minutes > 0:
        raise TrainHeadError(f"--minutes must be > 0, got {args.minutes}")
    if not 0 < args.held_out < 1:
        raise TrainHeadError(f"--held-out must be a fraction in (0, 1), got {args.held_out}")
    for f in [*args.text, *([args.prompts] if args.prompts else [])]:
        if not os.path.isfile(f):
            raise TrainHeadError(f"{f!r} is not a file")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise TrainHeadError(f"--out {str(out)!r} exists and is not a folder")
    if args.resume:
        if args.force:
            raise TrainHeadError("--resume and --force exclude each other")
        if not (out / STATE_FILE).is_file() or not (out / DATA_FILE).is_file():
            raise TrainHeadError(
                f"--resume: {str(out)!r} holds no training to resume ({STATE_FILE} and "
                f"{DATA_FILE} are written at the first checkpoint)"
            )
    elif out.is_dir() and any(out.iterdir()) and not args.force:
        raise TrainHeadError(
            f"--out {str(out)!r} is not empty; choose another folder, --resume the training "
            "in it, or pass --force to start afresh"
        )
    return out


def _read_lines(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainHeadError(f"{path!r} cannot be read as UTF-8 text: {exc}") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def _prompt_ids(args: argparse.Namespace, pipe: Any) -> list[list[int]]:
    prompts = _read_lines(args.prompts) if args.prompts else shipped_prompts()
    has_template = getattr(pipe.tokenizer, "chat_template", None) is not None
    ids = [pipe.encode_prompt(p, chat_template=has_template) for p in prompts]
    for f in args.text:
        toks = [int(t) for t in pipe.tokenizer.encode(Path(f).read_text(encoding="utf-8"))]
        ids.extend(toks[i : i + args.seq_len] for i in range(0, len(toks) - 2, args.seq_len))
    ids = [list(p) for p in ids if len(p) >= 1]
    if len(ids) < 2:
        raise TrainHeadError("need at least 2 prompts or text windows (one is held out)")
    # A seeded shuffle: --max-sequences and the held-out tail mix prompts and windows.
    random.Random(args.seed).shuffle(ids)
    return ids[: args.max_sequences]


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return [int(t) for t in ids]


def _make_data(args: argparse.Namespace, pipe: Any, show: bool) -> tuple[dict, tuple[list, list]]:
    """The model's answers: ``--answers`` per prompt (the first greedy), whole prompts held
    out (their answers are alike, so a held-out answer of a trained prompt would flatter)."""
    from .train import batch_answers

    prompts = _prompt_ids(args, pipe)
    n_held = max(1, round(len(prompts) * args.held_out))
    if n_held >= len(prompts):
        raise TrainHeadError(
            f"--held-out {args.held_out} of {len(prompts)} prompts leaves none to train on; "
            "lower it or add prompts"
        )
    total = len(prompts) * args.answers
    bar = specdec.Progress(total, prefix="train-head: the model answers", enabled=show)
    eos = _eos_ids(pipe.tokenizer)
    answers: list[list[list[int]]] = [[] for _ in prompts]
    states: list[list[Any]] = [[] for _ in prompts]
    for a in range(args.answers):
        temp = 0.0 if a == 0 else args.sample_temp
        bar.start(f"answer {a + 1} of {args.answers}" + (f" (temp {temp})" if temp else ""))
        got = batch_answers(
            pipe.model,
            prompts,
            max_tokens=args.continue_tokens,
            eos=eos,
            temperature=temp,
            seed=args.seed + a,
            record=args.candidates,
            on_batch=bar.advance,
        )
        if got is not None:
            got, recorded = got
        else:  # a model with linear-attention caches: one prompt at a time
            got, recorded = [], [None] * len(prompts)
            for p in prompts:
                res = pipe.generate(
                    p, max_tokens=args.continue_tokens, temperature=temp, seed=args.seed + a
                )
                got.append(list(res.tokens))
                bar.advance()
        for i, ans in enumerate(got):
            answers[i].append(list(prompts[i]) + list(ans))
            states[i].append(recorded[i])
    bar.close()
    train = [s for group in answers[:-n_held] for s in group]
    held = [s for group in answers[-n_held:] for s in group]
    data = {"train": train, "held_out": held, "prompts": len(prompts), "held_out_prompts": n_held}
    # The target's states over the training text, recorded while it wrote it (not saved:
    # --resume computes them again).
    return data, (
        [st for group in states[:-n_held] for st in group],
        [st for group in states[-n_held:] for st in group],
    )


def cmd_train_head(args: argparse.Namespace) -> int:
    """Run ``specdec train-head``."""
    out = _check(args)
    from .checkpoint import save_hf_checkpoint
    from .mtp import TARGET_FIELD, load_mtp, target_identity
    from .train import train_mtp_head

    t0 = time.perf_counter()
    show = not args.no_progress
    pipe = specdec.assemble(args.model, policy="none")
    model = pipe.model
    identity = target_identity(model)
    if args.loss == "sampled":
        if not specdec.training.TargetOutput(model).affine:  # before minutes of answers
            raise TrainHeadError(
                "--loss sampled needs an affine output layer and this model's is not (e.g. "
                "soft-capped logits); use --loss full or auto"
            )
    init, start = None, 0
    data_seconds = 0.0
    states = held_states = None
    if args.resume:
        state = json.loads((out / STATE_FILE).read_text())
        data = json.loads((out / DATA_FILE).read_text())
        if state.get("target") != identity:
            raise TrainHeadError(f"--resume: the training in {str(out)!r} is for another model")
        for key, flag in (("seed", "--seed"), ("batch_size", "--batch-size")):
            if key in state and state[key] != getattr(args, key):
                raise TrainHeadError(
                    f"--resume: the training in {str(out)!r} ran with {flag} {state[key]}; "
                    f"give the same {flag} to continue its minibatch order"
                )
        data_seconds = float(state.get("data_seconds", 0.0))
        import mlx.core as mx

        init, _ = load_mtp(model, out, dtype=mx.float32)  # trained on in float32
        start = int(state["step"])
        if start >= args.steps:
            raise TrainHeadError(
                f"--resume: {start} steps are done already; give --steps above {start}"
            )
    else:
        out.mkdir(parents=True, exist_ok=True)
        for name in (STATE_FILE, DATA_FILE, SUMMARY_FILE):
            (out / name).unlink(missing_ok=True)
        t_data = time.perf_counter()
        data, (states, held_states) = _make_data(args, pipe, show)
        data_seconds = round(time.perf_counter() - t_data, 1)
        (out / DATA_FILE).write_text(json.dumps(data) + "\n")

    def save(step: int, head: Any) -> None:
        save_hf_checkpoint(out, model, head, trunk=False, extra_config={TARGET_FIELD: identity})
        state = {
            "step": step,
            "target": identity,
            "lr": args.lr,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "data_seconds": data_seconds,
        }
        (out / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    bar = specdec.Progress(args.steps - start, prefix="train-head: training", enabled=show)
    bar.start(f"step {start}")

    def progress(step: int, total: int, loss: float, held: float | None) -> None:
        bar.advance()
        label = f"loss {loss:.3f}" + ("" if held is None else f", held-out top-1 {held:.1%}")
        if step % args.save_every == 0 or step == total:
            bar.start(label)  # a line in a log too (a terminal redraws every step)
        else:
            bar.label = label

    try:
        head, st = train_mtp_head(
            model,
            data["train"],
            steps=args.steps,
            lr=args.lr,
            layers=args.layers,
            seed=args.seed,
            init=init,
            start_step=start,
            batch_size=args.batch_size,
            loss=args.loss,
            candidates=args.candidates,
            negatives=args.negatives,
            time_limit=None if args.minutes is None else args.minutes * 60.0,
            states=states,
            held_out_states=held_states,
            held_out=data["held_out"],
            eval_every=args.save_every,
            progress=progress,
            checkpoint=save,
            checkpoint_every=args.save_every,
        )
    except ValueError as exc:  # e.g. no sequence long enough to train on
        raise TrainHeadError(str(exc)) from exc
    bar.close()
    save(st["steps"], head)
    summary = {
        "out": str(out),
        "train_sequences": len(data["train"]),
        "held_out_sequences": len(data["held_out"]),
        "train_tokens": sum(len(s) for s in data["train"]),
        "prompts": data.get("prompts"),
        "held_out_prompts": data.get("held_out_prompts"),
        "resumed_at": start,
        "data_seconds": data_seconds,
        **st,
        "seconds": round(time.perf_counter() - t0, 1),
        "target": identity,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"train-head: {summary['train_sequences']} sequences ({summary['train_tokens']} tokens), "
        f"steps {start + 1}..{st['steps']}: loss {st['first_loss']:.3f} -> {st['last_loss']:.3f}; "
        f"first-draft agreement with the model: {st['top1']:.1%} on the training text, "
        f"{st['held_out_top1']:.1%} held out; {summary['seconds']} s"
        + (" (stopped by --minutes)" if st["stopped_by_time"] else "")
        + f"; head in {out}",
        file=sys.stderr,
    )
    print(
        "use it with a policy file:\n"
        '  drafters = ["qwen_mtp"]\n  verifier = "hidden"\n\n'
        f"  [options.qwen_mtp]\n  mtp_path = {json.dumps(str(out))}"
    )
    return 0
