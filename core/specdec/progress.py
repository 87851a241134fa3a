"""A dependency-free progress bar on stderr (``specdec bench``, verify-cost profiling).

On a terminal it redraws one line (``\\r``); otherwise (a pipe, a log file) it
writes one line per step, or only a first and a last line (``pipe="ends"``), so
logs stay readable. The bench draws it only between runs, never inside a timed
generation.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``[#####-----]  5/12  label  (elapsed)``.

    Args:
        total: the number of steps.
        stream: where to draw (default: ``sys.stderr``).
        enabled: ``False`` draws nothing.
        width: the bar's width in characters.
        prefix: text before the bar.
        pipe: off a terminal, ``"every"`` writes a line per step, ``"ends"`` only the
            first step's line and the closing one.
    """

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        enabled: bool = True,
        width: int = 24,
        prefix: str = "specdec bench",
        pipe: str = "every",
    ):
        if pipe not in ("every", "ends"):
            raise ValueError(f"Progress: pipe must be 'every' or 'ends', got {pipe!r}")
        self.pipe = pipe
        self.total = max(int(total), 1)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.width = width
        self.prefix = prefix
        self.done = 0
        self.label = ""
        self._t0 = time.monotonic()
        self._last_len = 0
        try:
            self.tty = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.tty = False

    def _line(self) -> str:
        filled = int(self.width * min(self.done, self.total) / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = int(time.monotonic() - self._t0)
        n = len(str(self.total))
        return (
            f"{self.prefix} [{bar}] {self.done:>{n}}/{self.total} "
            f"{elapsed // 60:d}:{elapsed % 60:02d} {self.label}"
        )

    def _draw(self, *, force: bool = False) -> None:
        if not self.enabled:
            return
        if not (force or self.tty or self.pipe == "every" or self.done == 0):
            return
        line = self._line()
        if self.tty:
            pad = " " * max(0, self._last_len - len(line))
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def start(self, label: str) -> None:
        """Show that the next step, ``label``, is running."""
        self.label = label
        self._draw()

    def advance(self, n: int = 1) -> None:
        """Mark ``n`` steps done (redrawn on a terminal only: a log gets one line per step)."""
        self.done += n
        if self.tty:
            self._draw()

    def close(self) -> None:
        """Finish the bar (a final line with every step done)."""
        if not self.enabled:
            return
        self.label = "done"
        self._draw(force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
