"""The bench's progress bar: :class:`specdec.progress.Progress` (kept here for imports)."""

from specdec.progress import Progress

__all__ = ["Progress"]
