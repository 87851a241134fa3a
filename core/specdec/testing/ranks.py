"""Running a program as the ranks of a distributed job on this machine, for tests.

``run_ranks`` starts ``n`` processes as ``mlx.launch --backend ring`` starts them
(``MLX_HOSTFILE`` naming a ring of ``n`` ports on 127.0.0.1, ``MLX_RANK``), each
in a process group of its own with one BLAS thread, and stops every one of them
when one fails or the time runs out, so a test of a sharded model can never
hang or leave processes behind. (``mlx.launch`` itself relays the ranks' output
in a loop that keeps a core busy: on a small test machine that is a core the
ranks lack.)
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["run_ranks"]


def _free_ports(n: int) -> int:
    """A port ``p`` with ``p .. p + n - 1`` free on 127.0.0.1."""
    for _ in range(200):
        p = random.randint(20000, 60000)
        ok = True
        for q in range(p, p + n):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", q))
                except OSError:
                    ok = False
                    break
        if ok:
            return p
    raise RuntimeError(f"no {n} free consecutive ports on 127.0.0.1")


def run_ranks(
    argv: Sequence[str],
    workdir: str | os.PathLike,
    *,
    n: int = 2,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Run ``argv`` as ``n`` ring ranks on 127.0.0.1 and return each rank's output.

    Args:
        argv: the program every rank runs (e.g. ``[sys.executable, "ranks.py", ...]``);
            it reads its rank from ``MLX_RANK`` (``specdec.distributed.launched_world()``
            and ``specdec.assemble`` find the group themselves).
        workdir: where the hosts file and each rank's output (``rank<r>.log``) go.
        n: how many ranks.
        timeout: seconds for the whole job; then every rank is killed.
        env: extra environment variables for every rank.

    Returns:
        Each rank's output (stdout and stderr together), in rank order.

    Raises:
        AssertionError: a rank exited with an error (the others are then stopped after a
            few seconds, so they can say what they saw), or the job ran past ``timeout``;
            the message holds the end of every rank's output.
    """
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    port = _free_ports(n)
    hosts = work / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(n)]))
    procs = []
    for r in range(n):
        penv = dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(r))
        penv["OPENBLAS_NUM_THREADS"] = "1"  # the ranks share this machine's cores
        penv.update(env or {})
        with open(work / f"rank{r}.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    list(argv),
                    env=penv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: killed with its children
                )
            )
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                end = min(deadline, time.monotonic() + 5)  # let the others say why
                while any(p.poll() is None for p in procs) and time.monotonic() < end:
                    time.sleep(0.1)
                break
            time.sleep(0.1)
    finally:
        running = [p for p in procs if p.poll() is None]
        for p in running:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait()
    outs = [(work / f"rank{r}.log").read_text(errors="replace") for r in range(n)]
    shown = "\n".join(
        f"--- rank {r} (exit {p.returncode}):\n{o[-4000:]}"
        for r, (p, o) in enumerate(zip(procs, outs))
    )
    if running and not any(p.returncode not in (None, 0, -signal.SIGKILL) for p in procs):
        raise AssertionError(f"the ranks ran past {timeout}s (a hang?) and were killed:\n{shown}")
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise AssertionError(f"rank(s) {failed} failed:\n{shown}")
    return outs
