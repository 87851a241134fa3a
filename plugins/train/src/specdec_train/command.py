"""The training commands' shared body (``specdec train-head``, ``specdec
train-assistant``): their flags (:func:`add_training_arguments`), the data (the model's
answers to the shipped prompts, :func:`shipped_prompts`, :func:`prompt_ids`), the
training with progress bars, checkpoints every ``--save-every`` steps and resuming
(:func:`run_training` with a :class:`TrainCommand`), and the held-out acceptance of a
trained head (:func:`held_out_acceptance`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from specdec import SpecdecError, assemble
from specdec.checkpoints import target_identity, text_model
from specdec.heads import model_vocab_size
from specdec.progress import Progress

from .loop import LOSSES, train_head
from .recording import TargetOutput, batch_answers

#: What a training command's output folder holds besides the head's checkpoint.
STATE_FILE = "train_state.json"
DATA_FILE = "train_data.json"
SUMMARY_FILE = "train_head.json"


class TrainError(SpecdecError, ValueError):
    """Bad input to a training command (the message names it and what would be accepted)."""


def shipped_prompts() -> list[str]:
    """The prompts shipped for self-distillation (``specdec_train/data/train_prompts.txt``; none
    is a bench workload)."""
    from importlib import resources

    text = resources.files("specdec_train").joinpath("data/train_prompts.txt").read_text("utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


@attrs.frozen
class TrainCommand:
    """What one training command adds to :func:`run_training`.

    Attributes:
        name: the subcommand (``"train-head"``), for messages and progress bars.
        make_trainer: ``make_trainer(model, args, resume)``: the :class:`HeadTrainer`;
            ``resume`` is the output folder to load the head from (float32), or ``None``
            for a new head.
        save: ``save(out, model, module, identity)``: write the head to ``out`` with the
            target's identity (:data:`specdec.checkpoints.TARGET_FIELD`) in its config.
        usage: ``usage(out)``: what to print on stdout at the end (how to use the head).
        train: the training loop, called as :func:`specdec_train.train_head` is (the same
            arguments, plus ``prompt_lengths`` and ``held_out_prompt_lengths``: how many
            leading tokens of each sequence are its prompt, ``None`` for the data of an
            older run; the same keys in the dict it returns, keys of its own go to the
            summary too); ``None``: :func:`train_head`. For a head that does not learn
            ``x[t+2]`` from the target's state at ``t+1`` (a DFlash drafter learns
            blocks).
    """

    name: str
    make_trainer: Callable[[Any, Any, Any], Any]
    save: Callable[[Any, Any, Any, dict], None]
    usage: Callable[[Any], str]
    train: Callable[..., dict] | None = None


def add_training_arguments(p: Any, *, lr: float = 1e-3) -> None:
    """Add the flags every training command has to the argparse parser ``p`` (a head's
    own flags, such as ``--layers``, are the command's)."""
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
    p.add_argument("--lr", type=float, default=lr, help=f"learning rate (default: {lr:g})")
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
        choices=LOSSES,
        default="auto",
        help="sampled: KL over a candidate set (plus, for a head scored by the target's "
        "output layer, the whole vocabulary's logit error through its Gram matrix): cheap; "
        "full: KL over the whole vocabulary; auto: sampled where the output layer is affine "
        "(default: auto)",
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
        "--data",
        default=None,
        metavar="FILE",
        help="train on the sequences of an earlier run's train_data.json (another head on the "
        "same text, without the model answering again) instead of new answers",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the seed of the initialisation, the minibatch order, the sampled answers and "
        "the negatives (default: 0)",
    )
    p.add_argument("--force", action="store_true", help="start afresh in a non-empty --out folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _check_args(args: Any) -> Any:
    import os
    from pathlib import Path

    for label, lo in (
        ("steps", 1),
        ("seq_len", 3),
        ("max_sequences", 2),
        ("continue_tokens", 1),
        ("save_every", 1),
        ("answers", 1),
        ("batch_size", 1),
        ("candidates", 1),
        ("negatives", 0),
    ):
        v = getattr(args, label)
        if v < lo:
            flag = "--continue" if label == "continue_tokens" else f"--{label.replace('_', '-')}"
            raise TrainError(f"{flag} must be >= {lo}, got {v}")
    if not args.lr > 0:
        raise TrainError(f"--lr must be > 0, got {args.lr}")
    if not args.sample_temp > 0:
        raise TrainError(f"--sample-temp must be > 0, got {args.sample_temp}")
    if args.minutes is not None and not args.minutes > 0:
        raise TrainError(f"--minutes must be > 0, got {args.minutes}")
    if not 0 < args.held_out < 1:
        raise TrainError(f"--held-out must be a fraction in (0, 1), got {args.held_out}")
    for f in [*args.text, *([args.prompts] if args.prompts else [])]:
        if not os.path.isfile(f):
            raise TrainError(f"{f!r} is not a file")
    data = getattr(args, "data", None)
    if data is not None:
        if args.resume:
            raise TrainError("--data and --resume exclude each other (a resumed run has its data)")
        if args.prompts or args.text:
            raise TrainError("--data takes the sequences of an earlier run: no --prompts or --text")
        _read_data(data)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {str(out)!r} exists and is not a folder")
    if args.resume:
        if args.force:
            raise TrainError("--resume and --force exclude each other")
        if not (out / STATE_FILE).is_file() or not (out / DATA_FILE).is_file():
            raise TrainError(
                f"--resume: {str(out)!r} holds no training to resume ({STATE_FILE} and "
                f"{DATA_FILE} are written at the first checkpoint)"
            )
    elif out.is_dir() and any(out.iterdir()) and not args.force:
        raise TrainError(
            f"--out {str(out)!r} is not empty; choose another folder, --resume the training "
            "in it, or pass --force to start afresh"
        )
    return out


def _read_data(path: str) -> dict:
    """An earlier run's ``train_data.json``: ``train`` and ``held_out`` token lists."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TrainError(f"--data {path!r} cannot be read as JSON: {exc}") from exc
    ok = isinstance(data, dict) and all(
        isinstance(data.get(k), list)
        and all(isinstance(s, list) and all(isinstance(t, int) for t in s) for s in data[k])
        for k in ("train", "held_out")
    )
    if not ok or not data["train"] or not data["held_out"]:
        raise TrainError(
            f"--data {path!r} is not a train_data.json: it needs non-empty 'train' and "
            "'held_out' lists of token-id lists"
        )
    for k in ("train", "held_out"):
        lengths = data.get(f"{k}_prompt_lengths")
        if lengths is not None and not (
            isinstance(lengths, list)
            and len(lengths) == len(data[k])
            and all(isinstance(n, int) and 0 <= n <= len(s) for n, s in zip(lengths, data[k]))
        ):
            raise TrainError(
                f"--data {path!r}: {k}_prompt_lengths must give one prompt length (0 .. the "
                f"sequence's length) per sequence of {k!r}"
            )
    return data


def _read_lines(path: str) -> list[str]:
    from pathlib import Path

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainError(f"{path!r} cannot be read as UTF-8 text: {exc}") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def prompt_ids(
    pipe: Any,
    *,
    prompts: str | None = None,
    text: Sequence[str] = (),
    seq_len: int = 128,
    seed: int = 0,
    max_sequences: int = 200,
) -> list[list[int]]:
    """The training commands' prompts as token lists, in their seeded order (the last
    ``--held-out`` of them are held out): the lines of ``prompts`` (a file; default the
    shipped ones) through the chat template when the tokenizer has one, then windows of
    ``seq_len`` tokens of each ``text`` file; shuffled with ``seed``, the first
    ``max_sequences`` kept."""
    from pathlib import Path

    lines = _read_lines(prompts) if prompts else shipped_prompts()
    has_template = getattr(pipe.tokenizer, "chat_template", None) is not None
    ids = [pipe.encode_prompt(p, chat_template=has_template) for p in lines]
    for f in text:
        toks = [int(t) for t in pipe.tokenizer.encode(Path(f).read_text(encoding="utf-8"))]
        ids.extend(toks[i : i + seq_len] for i in range(0, len(toks) - 2, seq_len))
    ids = [list(p) for p in ids if len(p) >= 1]
    if len(ids) < 2:
        raise TrainError("need at least 2 prompts or text windows (one is held out)")
    # A seeded shuffle: --max-sequences and the held-out tail mix prompts and windows.
    random.Random(seed).shuffle(ids)
    return ids[:max_sequences]


def _prompt_ids(args: Any, pipe: Any) -> list[list[int]]:
    return prompt_ids(
        pipe,
        prompts=args.prompts,
        text=args.text,
        seq_len=args.seq_len,
        seed=args.seed,
        max_sequences=args.max_sequences,
    )


def _eos_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        one = getattr(tokenizer, "eos_token_id", None)
        ids = [] if one is None else [one]
    return [int(t) for t in ids]


def _make_data(
    args: Any,
    pipe: Any,
    show: bool,
    command: str,
    kv_layers: Sequence[int],
    layers: Sequence[int] = (),
) -> tuple[dict, tuple[list, list]]:
    """The model's answers: ``--answers`` per prompt (the first greedy), whole prompts held
    out (their answers are alike, so a held-out answer of a trained prompt would flatter)."""
    prompts = _prompt_ids(args, pipe)
    n_held = max(1, round(len(prompts) * args.held_out))
    if n_held >= len(prompts):
        raise TrainError(
            f"--held-out {args.held_out} of {len(prompts)} prompts leaves none to train on; "
            "lower it or add prompts"
        )
    total = len(prompts) * args.answers
    bar = Progress(total, prefix=f"{command}: the model answers", enabled=show)
    eos = _eos_ids(pipe.tokenizer)
    answers: list[list[list[int]]] = [[] for _ in prompts]
    states: list[list[Any]] = [[] for _ in prompts]
    for a in range(args.answers):
        temp = 0.0 if a == 0 else args.sample_temp
        bar.start(f"answer {a + 1} of {args.answers}" + (f" (temp {temp})" if temp else ""))
        batched = batch_answers(
            pipe.model,
            prompts,
            max_tokens=args.continue_tokens,
            eos=eos,
            temperature=temp,
            seed=args.seed + a,
            record=args.candidates,
            kv_layers=kv_layers,
            layers=layers,
            on_batch=bar.advance,
        )
        got: list[list[int]]
        recorded: list[Any]
        if batched is not None:
            got, recorded = batched
        else:  # sliding-window or linear-attention caches: one prompt at a time
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
    lengths = [len(p) for p, group in zip(prompts, answers) for _ in group]
    data = {
        "train": train,
        "held_out": held,
        "prompts": len(prompts),
        "held_out_prompts": n_held,
        "held_out_prompt_ids": prompts[-n_held:],
        # how many leading tokens of each sequence are its prompt (specdec-train 0.1.1)
        "train_prompt_lengths": lengths[: len(train)],
        "held_out_prompt_lengths": lengths[len(train) :],
    }
    # The target's states over the training text, recorded while it wrote it (not saved:
    # --resume computes them again).
    return data, (
        [st for group in states[:-n_held] for st in group],
        [st for group in states[-n_held:] for st in group],
    )


def run_training(args: Any, command: TrainCommand) -> int:
    """Run a training command: the model answers the prompts, the head trains on the
    answers (progress bars on stderr, checkpoints every ``--save-every`` steps, resumable),
    and a summary is written to ``train_head.json``.

    Raises:
        TrainError: bad arguments (before the model is loaded), or a training that
            cannot run.
    """
    import json
    import sys

    out = _check_args(args)
    t0 = time.perf_counter()
    show = not args.no_progress
    pipe = assemble(args.model, policy="none")
    model = pipe.model
    identity = target_identity(model)
    if args.loss == "sampled" and not TargetOutput(model).affine:  # before minutes of answers
        raise TrainError(
            "--loss sampled needs an affine output layer and this model's is not (e.g. "
            "soft-capped logits); use --loss full or auto"
        )
    start = 0
    data_seconds = 0.0
    states = held_states = None
    if args.resume:
        state = json.loads((out / STATE_FILE).read_text())
        data = json.loads((out / DATA_FILE).read_text())
        if state.get("target") != identity:
            raise TrainError(f"--resume: the training in {str(out)!r} is for another model")
        for key, flag in (("seed", "--seed"), ("batch_size", "--batch-size")):
            if key in state and state[key] != getattr(args, key):
                raise TrainError(
                    f"--resume: the training in {str(out)!r} ran with {flag} {state[key]}; "
                    f"give the same {flag} to continue its minibatch order"
                )
        data_seconds = float(state.get("data_seconds", 0.0))
        start = int(state["step"])
        if start >= args.steps:
            raise TrainError(
                f"--resume: {start} steps are done already; give --steps above {start}"
            )
        trainer = command.make_trainer(model, args, out)
    else:
        trainer = command.make_trainer(model, args, None)
        out.mkdir(parents=True, exist_ok=True)
        for name in (STATE_FILE, DATA_FILE, SUMMARY_FILE):
            (out / name).unlink(missing_ok=True)
        t_data = time.perf_counter()
        kv_layers = tuple(getattr(trainer, "kv_layers", ()) or ())
        # the outputs of decoder layers a head is conditioned on (a DFlash drafter's)
        layers = tuple(getattr(trainer, "feature_layers", ()) or ())
        if getattr(args, "data", None) is not None:
            # the target's states are recorded again, one teacher-forced forward each
            data = _read_data(args.data)
            vocab = int(model_vocab_size(text_model(model)) or 0)
            if any(t >= vocab or t < 0 for s in data["train"] + data["held_out"] for t in s):
                raise TrainError(
                    f"--data {args.data!r} has token ids outside this model's vocabulary"
                )
        else:
            data, (states, held_states) = _make_data(
                args, pipe, show, command.name, kv_layers, layers
            )
        data_seconds = round(time.perf_counter() - t_data, 1)
        (out / DATA_FILE).write_text(json.dumps(data) + "\n")

    def save(step: int, module: Any) -> None:
        command.save(out, model, module, identity)
        state = {
            "step": step,
            "target": identity,
            "lr": args.lr,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "data_seconds": data_seconds,
        }
        (out / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")

    bar = Progress(args.steps - start, prefix=f"{command.name}: training", enabled=show)
    bar.start(f"step {start}")

    def progress(step: int, total: int, loss: float, held: float | None) -> None:
        bar.advance()
        label = f"loss {loss:.3f}" + ("" if held is None else f", held-out top-1 {held:.1%}")
        if step % args.save_every == 0 or step == total:
            bar.start(label)  # a line in a log too (a terminal redraws every step)
        else:
            bar.label = label

    loop = command.train or train_head
    try:
        st = loop(
            model,
            trainer,
            data["train"],
            steps=args.steps,
            lr=args.lr,
            seed=args.seed,
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
            name=command.name,
            **(
                {
                    "prompt_lengths": data.get("train_prompt_lengths"),
                    "held_out_prompt_lengths": data.get("held_out_prompt_lengths"),
                }
                if command.train is not None
                else {}
            ),
        )
    except ValueError as exc:  # e.g. no sequence long enough to train on
        raise TrainError(str(exc)) from exc
    bar.close()
    save(st["steps"], trainer.module)
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
        f"{command.name}: {summary['train_sequences']} sequences ({summary['train_tokens']} "
        f"tokens), steps {start + 1}..{st['steps']}: loss {st['first_loss']:.3f} -> "
        f"{st['last_loss']:.3f}; first-draft agreement with the model: {st['top1']:.1%} on "
        f"the training text, {st['held_out_top1']:.1%} held out; {summary['seconds']} s"
        + (" (stopped by --minutes)" if st["stopped_by_time"] else "")
        + f"; head in {out}",
        file=sys.stderr,
    )
    print(command.usage(out))
    return 0


def held_out_acceptance(
    folder: str | Any,
    policy: Any,
    drafter: str,
    *,
    model: Any = None,
    max_tokens: int = 128,
) -> dict:
    """Per-position acceptance of a trained head on the prompts its training held out.

    The prompts are the ``held_out_prompt_ids`` of ``folder``'s ``train_data.json``
    (written by :func:`run_training` since core 0.2.7). Each one is generated greedily
    with ``policy`` (whose drafter ``drafter`` reports ``position_reached`` and
    ``position_accepted`` in its stats, as ``qwen_mtp`` and ``gemma4_mtp`` do; pass a
    fixed depth, ``adaptive = false``, to measure every position) and with plain
    decoding, and the outputs are compared.

    Args:
        folder: the trained head's folder.
        policy: the policy (a :class:`specdec.Policy`, a preset name, a TOML path or a
            dict) that drafts with the head.
        drafter: the name of the drafter whose per-position stats are summed.
        model: the target (a loaded mlx-lm model, a path, ``None``: the default model).
        max_tokens: tokens generated per prompt.

    Returns:
        ``{"prompts", "position_reached", "position_accepted", "position_acceptance",
        "conditional_acceptance", "tokens_per_forward", "identical"}``:
        ``position_reached[i]``: rounds that drafted position ``i + 1``;
        ``position_accepted[i]``: of those, how many accepted it (every earlier draft was
        accepted too); ``position_acceptance``: their ratio; ``conditional_acceptance[i]``:
        of the rounds that accepted position ``i`` (all rounds for the first), the share
        that accepted position ``i + 1`` too; ``identical``: every output equals plain
        decoding's.

    Raises:
        TrainError: ``train_data.json`` is missing or does not list its held-out prompts,
            or ``drafter`` reports no per-position stats.
    """
    import json
    from pathlib import Path

    path = Path(folder) / DATA_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TrainError(f"cannot read {path}: {exc}") from exc
    prompts = data.get("held_out_prompt_ids") if isinstance(data, dict) else None
    if prompts is not None and not prompts:
        raise TrainError(f"{path} holds no prompt out (its held_out_prompt_ids is empty)")
    if not prompts:
        raise TrainError(
            f"{path} does not list its held-out prompts (held_out_prompt_ids, written by "
            "specdec train-head and train-assistant since specdec-core 0.2.7): run the "
            "training command again (--data FILE reuses a newer run's train_data.json)"
        )
    pipe = assemble(model, policy=policy)
    plain = assemble(pipe.model, tokenizer=pipe.tokenizer, policy="none")
    reached: list[int] = []
    accepted: list[int] = []
    forwards = tokens = 0
    identical = True
    for p in prompts:
        out = pipe.generate(p, max_tokens=max_tokens)
        ref = plain.generate(p, max_tokens=max_tokens)
        identical &= out.tokens == ref.tokens
        st = out.stats.per_drafter.get(drafter) or {}
        if "position_reached" not in st:
            raise TrainError(
                f"the drafter {drafter!r} reports no position_reached/position_accepted "
                f"stats (per_drafter has {sorted(out.stats.per_drafter)})"
            )
        for i, (r, a) in enumerate(zip(st["position_reached"], st["position_accepted"])):
            if i == len(reached):
                reached.append(0)
                accepted.append(0)
            reached[i] += r
            accepted[i] += a
        forwards += out.stats.target_forwards
        tokens += out.stats.generation_tokens
    return {
        "prompts": len(prompts),
        "position_reached": reached,
        "position_accepted": accepted,
        "position_acceptance": [round(a / r, 4) if r else None for a, r in zip(accepted, reached)],
        "conditional_acceptance": [
            round(a / r, 4) if r else None for a, r in zip(accepted, [reached[0], *accepted[:-1]])
        ]
        if reached
        else [],
        "tokens_per_forward": round(tokens / forwards, 3) if forwards else None,
        "identical": identical,
    }
