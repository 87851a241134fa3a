"""``python -m specdec_gemma4_mtp costs ...``: what an assistant step costs (see
:mod:`specdec_gemma4_mtp.costs`)."""

from __future__ import annotations

import sys

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv or argv[0] != "costs":
        sys.exit("usage: python -m specdec_gemma4_mtp costs [--model M --assistant A | --random-weights e2b] ...")
    from .costs import main

    sys.exit(main(argv[1:]))
