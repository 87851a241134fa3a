"""``python -m specdec_dflash costs --path FOLDER ...``: what a draft forward costs against
a target step (see :mod:`specdec_dflash.costs`)."""

from __future__ import annotations

import sys

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["costs"]:
        from .costs import main

        sys.exit(main(argv[1:]))
    sys.exit("usage: python -m specdec_dflash costs --path DFLASH_FOLDER [--model M] ...")
