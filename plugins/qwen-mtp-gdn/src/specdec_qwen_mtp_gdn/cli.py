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
        default=48,
        help="sequences in all, held out ones too (default: 48)",
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
        "--held-out", type=float, default=0.1, help="fraction of sequences held out (default: 0.1)"
    )
    p.add_argument(
        "--soft-top-k",
        type=int,
        default=64,
        help="distil the target's distribution over its k most likely tokens (0: the text's "
        "tokens as labels; default: 64)",
    )
    p.add_argument(
        "--save-every", type=int, default=50, help="checkpoint interval in steps (default: 50)"
    )
    p.add_argument("--resume", action="store_true", help="continue the training saved in --out")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
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
        ("soft_top_k", 0),
    ):
        v = getattr(args, name)
        if v < lo:
            flag = "--continue" if name == "continue_tokens" else f"--{name.replace('_', '-')}"
            raise TrainHeadError(f"{flag} must be >= {lo}, got {v}")
    if not args.lr > 0:
        raise TrainHeadError(f"--lr must be > 0, got {args.lr}")
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


def _make_data(args: argparse.Namespace, pipe: Any, show: bool) -> dict:
    prompts = _prompt_ids(args, pipe)
    bar = specdec.Progress(len(prompts), prefix="train-head: the model answers", enabled=show)
    seqs = []
    for p in prompts:
        bar.start(f"{len(p)} prompt tokens")
        seqs.append(list(p) + list(pipe.generate(p, max_tokens=args.continue_tokens).tokens))
        bar.advance()
    bar.close()
    n_held = max(1, round(len(seqs) * args.held_out))
    if n_held >= len(seqs):
        raise TrainHeadError(
            f"--held-out {args.held_out} of {len(seqs)} sequences leaves none to train on; "
            "lower it or add prompts"
        )
    return {"train": seqs[:-n_held], "held_out": seqs[-n_held:]}


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
    init, start = None, 0
    if args.resume:
        state = json.loads((out / STATE_FILE).read_text())
        data = json.loads((out / DATA_FILE).read_text())
        if state.get("target") != identity:
            raise TrainHeadError(f"--resume: the training in {str(out)!r} is for another model")
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
        data = _make_data(args, pipe, show)
        (out / DATA_FILE).write_text(json.dumps(data) + "\n")

    def save(step: int, head: Any) -> None:
        save_hf_checkpoint(out, model, head, trunk=False, extra_config={TARGET_FIELD: identity})
        state = {"step": step, "target": identity, "lr": args.lr, "seed": args.seed}
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

    head, st = train_mtp_head(
        model,
        data["train"],
        steps=args.steps,
        lr=args.lr,
        layers=args.layers,
        seed=args.seed,
        init=init,
        start_step=start,
        soft_top_k=args.soft_top_k or None,
        held_out=data["held_out"],
        eval_every=args.save_every,
        progress=progress,
        checkpoint=save,
        checkpoint_every=args.save_every,
    )
    bar.close()
    save(args.steps, head)
    summary = {
        "out": str(out),
        "train_sequences": len(data["train"]),
        "held_out_sequences": len(data["held_out"]),
        "train_tokens": sum(len(s) for s in data["train"]),
        "resumed_at": start,
        **st,
        "seconds": round(time.perf_counter() - t0, 1),
        "target": identity,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"train-head: {summary['train_sequences']} sequences ({summary['train_tokens']} tokens), "
        f"steps {start + 1}..{st['steps']}: loss {st['first_loss']:.3f} -> {st['last_loss']:.3f}; "
        f"first-draft agreement with the model: {st['top1']:.1%} on the training text, "
        f"{st['held_out_top1']:.1%} held out; {summary['seconds']} s; head in {out}",
        file=sys.stderr,
    )
    print(
        "use it with a policy file:\n"
        '  drafters = ["qwen_mtp"]\n  verifier = "hidden"\n\n'
        f"  [options.qwen_mtp]\n  mtp_path = {json.dumps(str(out))}"
    )
    return 0
