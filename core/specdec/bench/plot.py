"""``specdec bench --plot FILE.png``: off/on decode speed and tokens per forward per workload.

matplotlib is optional: it is imported only here, only when a plot is asked for.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["MATPLOTLIB_MISSING", "matplotlib_available", "plot_results"]

MATPLOTLIB_MISSING = "--plot needs matplotlib, which is not installed: pip install matplotlib"


def matplotlib_available() -> bool:
    """Whether matplotlib can be imported (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def plot_results(results: Sequence[Any], path: str | os.PathLike, *, title: str = "") -> None:
    """Draw two panels, one bar group per workload and temperature, and save them to ``path``.

    Left: decode tok/s with the ``none`` policy (off) and with the chosen policy (on),
    medians over the runs, and above each pair the record's ``ratio`` (the median of
    the rounds' own on/off ratios, so not always the two bars' quotient). Right: tokens per target forward with the policy.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - exercised without matplotlib
        raise ImportError(MATPLOTLIB_MISSING) from exc

    records = [r.record() for r in results]
    temps = {r["temp"] for r in records}
    policies = list(dict.fromkeys(r["policy"] for r in records))
    labels = [
        "\n".join(
            [r["workload"]]
            + ([f"temp {r['temp']:g}"] if len(temps) > 1 else [])
            + ([r["policy"]] if len(policies) > 1 else [])
        )
        for r in records
    ]
    x = list(range(len(records)))
    w = 0.38
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(records) + 3), 4.2))
    off = [r["off_tps"] for r in records]
    on = [r["on_tps"] for r in records]
    policy = policies[0] if len(policies) == 1 else "policy"
    ax1.bar([i - w / 2 for i in x], off, w, label="none (off)", color="#9aa5b1")
    ax1.bar([i + w / 2 for i in x], on, w, label=f"{policy} (on)", color="#2f7ed8")
    for i, r in enumerate(records):
        ax1.annotate(
            f"{r['ratio']:.2f}x",
            (i + w / 2, r["on_tps"]),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax1.set_xticks(x, labels)
    ax1.set_ylabel("decode tok/s (median)")
    ax1.set_title("decode speed")
    ax1.legend(fontsize=8)
    ax1.margins(y=0.15)

    tpf = [r["tokens_per_forward"] for r in records]
    ax2.bar(x, tpf, 0.5, color="#2f7ed8")
    ax2.axhline(1.0, color="#9aa5b1", linewidth=1, linestyle="--")
    for i, v in enumerate(tpf):
        ax2.annotate(f"{v:.2f}", (i, v), ha="center", va="bottom", fontsize=9)
    ax2.set_xticks(x, labels)
    ax2.set_ylabel("tokens per target forward")
    ax2.set_title(f"{policy}: tokens per forward")
    ax2.margins(y=0.15)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)
    plt.close(fig)
