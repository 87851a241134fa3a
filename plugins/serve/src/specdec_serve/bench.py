"""``specdec bench-serve``: an agent's conversation replayed against servers, side by side.

Each contender is a server started in its own process on 127.0.0.1 for one
conversation (so every conversation starts with an empty prefix cache): ``specdec
serve`` with the policy, the same with its prefix cache off, and ``mlx_lm.server``
(with the same fast BLAS preloaded that ``import specdec`` loads, so that both run
the same matmuls). One client replays the shipped workload turn by turn, streaming,
greedy: every turn resends the whole conversation with the server's own earlier
answers in it, as an editor's agent does. Measured per conversation: the wall time
of all its turns; per turn: the time to the first token of the answer, tokens,
tokens the server took from its prefix cache (as its usage reports them). The
contenders take turns (interleaved), ``--runs`` conversations each; medians and
ranges are reported, and whether every turn's text equals ``mlx_lm.server``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from importlib import resources
from typing import Any

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: contenders: label -> what runs
SPECDEC, NOCACHE, MLX_LM = "specdec", "specdec, no prefix cache", "mlx_lm.server"


def load_workload() -> dict:
    """The shipped agent-loop workload (``data/agent-loop.toml``)."""
    text = resources.files("specdec_serve").joinpath("data/agent-loop.toml").read_text("utf-8")
    return tomllib.loads(text)


@attrs.define
class Turn:
    text: str
    ttft_s: float
    total_s: float
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _command(contender: str, model: str, policy: str, port: int) -> tuple[list[str], dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if contender == MLX_LM:
        from specdec.loading import fast_blas_library

        lib = fast_blas_library()
        if lib is not None:
            env["LD_PRELOAD"] = lib
        return [sys.executable, "-m", "mlx_lm.server", "--model", model, "--port", str(port)], env
    cmd = [sys.executable, "-m", "specdec", "serve", "--model", model, "--policy", policy]
    cmd += ["--port", str(port), "--log-level", "warning"]
    if contender == NOCACHE:
        cmd += ["--prompt-cache-bytes", "0"]
    return cmd, env


class _Server:
    """A contender's server process, up until closed."""

    def __init__(self, contender: str, model: str, policy: str, log: Any) -> None:
        import httpx

        self.port = _free_port()
        cmd, env = _command(contender, model, policy, self.port)
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
        self.base = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{contender} exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"{contender} did not start within 600 s")
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _turn(base: str, messages: list[dict], max_tokens: int) -> Turn:
    """One streamed, greedy chat request."""
    import httpx

    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts: list[str] = []
    usage: dict = {}
    ttft = None
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=1800) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{base}: HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{base}: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices") or []:
                text = (c.get("delta") or {}).get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(text)
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    return Turn(
        "".join(parts),
        ttft if ttft is not None else total,
        total,
        int(usage.get("completion_tokens") or 0),
        int(usage.get("prompt_tokens") or 0),
        details.get("cached_tokens"),
    )


def conversation(base: str, work: dict, max_tokens: int) -> list[Turn]:
    """Replay the workload against one server: each turn the whole conversation so far."""
    msgs = [
        {"role": "system", "content": work["system"]},
        {"role": "user", "content": work["first"].format(source=work["source"])},
    ]
    turns = []
    for i in range(1 + len(work["turns"])):
        t = _turn(base, msgs, max_tokens)
        turns.append(t)
        if i < len(work["turns"]):
            msgs += [
                {"role": "assistant", "content": t.text},
                {"role": "user", "content": work["turns"][i]},
            ]
    return turns


def _med(xs: list[float]) -> str:
    if not xs:
        return "-"
    m = statistics.median(xs)
    return f"{m:.2f}" if len(xs) == 1 else f"{m:.2f} ({min(xs):.2f}-{max(xs):.2f})"


def run(args: argparse.Namespace) -> dict:
    """Every contender's conversations, interleaved; returns what was measured."""
    from specdec.loading import default_model_path

    model = args.model or str(default_model_path())
    work = load_workload()
    contenders = [SPECDEC, NOCACHE] + ([MLX_LM] if args.baseline else [])
    results: dict[str, list[list[Turn]]] = {c: [] for c in contenders}
    log = open(args.server_log, "ab") if args.server_log else subprocess.DEVNULL
    for r in range(args.runs):
        order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
        for c in order:
            print(f"bench-serve: run {r + 1}/{args.runs}: {c} ...", file=sys.stderr, flush=True)
            srv = _Server(c, model, args.policy, log)
            try:
                t0 = time.perf_counter()
                turns = conversation(srv.base, work, args.max_tokens)
                wall = time.perf_counter() - t0
            finally:
                srv.close()
            results[c].append(turns)
            ttfts = " ".join(f"{t.ttft_s:.2f}" for t in turns)
            print(
                f"bench-serve:   {wall:.1f} s; first token per turn {ttfts} s; prompt tokens "
                f"{[t.prompt_tokens for t in turns]}; cached {[t.cached_tokens for t in turns]}",
                file=sys.stderr,
                flush=True,
            )
    return {"model": model, "policy": args.policy, "results": results, "contenders": contenders}


def report(out: dict) -> dict:
    """The table (printed) and a JSON-able summary."""
    results, contenders = out["results"], out["contenders"]
    ref = results.get(MLX_LM)
    summary: dict[str, Any] = {"model": out["model"], "policy": out["policy"], "contenders": {}}
    n_turns = len(next(iter(results.values()))[0])
    print(f"model {out['model']}, policy {out['policy']!r}, {n_turns} turns, greedy")
    header = ["contender", "conversation s", *[f"TTFT {i + 1} s" for i in range(n_turns)]]
    header += ["tokens", "identical to mlx_lm.server"]
    print(" | ".join(header))
    for c in contenders:
        runs = results[c]
        walls = [sum(t.total_s for t in turns) for turns in runs]
        ttft = [[turns[i].ttft_s for turns in runs] for i in range(n_turns)]
        same = None
        if ref is not None and c != MLX_LM:
            same = all(
                [t.text for t in a] == [t.text for t in b] for a in runs for b in ref[: len(runs)]
            )
        toks = [sum(t.completion_tokens for t in turns) for turns in runs]
        print(
            " | ".join(
                [c, _med(walls), *[_med(x) for x in ttft], str(statistics.median(toks))]
                + ["-" if same is None else ("yes" if same else "NO")]
            )
        )
        summary["contenders"][c] = {
            "conversation_s": walls,
            "ttft_s": ttft,
            "completion_tokens": toks,
            "prompt_tokens": [t.prompt_tokens for t in runs[0]],
            "cached_tokens": [t.cached_tokens for t in runs[0]],
            "identical_to_mlx_lm": same,
        }
    s = summary["contenders"]

    def later_ttft(c: str) -> float:
        """The median over turns 2+ of each turn's median time to first token."""
        return statistics.median(statistics.median(x) for x in s[c]["ttft_s"][1:])

    both = MLX_LM in s and n_turns > 1
    # end to end: mlx_lm.server's conversation time over specdec's (> 1: specdec faster)
    summary["speedup_vs_mlx_lm"] = (
        statistics.median(s[MLX_LM]["conversation_s"])
        / statistics.median(s[SPECDEC]["conversation_s"])
        if MLX_LM in s
        else None
    )
    # time to first token of turns 2+: specdec's over mlx_lm.server's (<= 1.2 is the target)
    summary["ttft_ratio_vs_mlx_lm"] = later_ttft(SPECDEC) / later_ttft(MLX_LM) if both else None
    # what the prefix cache does for it: without over with
    summary["ttft_cache_gain"] = later_ttft(NOCACHE) / later_ttft(SPECDEC) if n_turns > 1 else None
    for k in ("speedup_vs_mlx_lm", "ttft_ratio_vs_mlx_lm", "ttft_cache_gain"):
        if summary[k] is not None:
            print(f"{k}: {summary[k]:.2f}")
    return summary


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench-serve",
        help="replay an agent's file-edit conversation against specdec serve (with and "
        "without its prefix cache) and mlx_lm.server, side by side",
        description=(__doc__ or "").split("\n\n", 1)[1].replace("``", ""),
    )
    p.add_argument(
        "--model", default=None, help="model folder (default: the built-in default model)"
    )
    p.add_argument("--policy", default="copy", help="specdec's policy (default: copy)")
    p.add_argument("--runs", type=int, default=2, help="conversations per contender (default: 2)")
    p.add_argument(
        "--max-tokens", "-m", type=int, default=600, help="tokens per answer at most (default: 600)"
    )
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="leave mlx_lm.server out",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the measurements here")
    p.add_argument(
        "--server-log", default=None, metavar="FILE", help="append the servers' output here"
    )
    p.set_defaults(func=cmd_bench_serve)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    if args.runs < 1 or args.max_tokens < 1:
        print("specdec bench-serve: error: --runs and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    summary = report(run(args))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0
