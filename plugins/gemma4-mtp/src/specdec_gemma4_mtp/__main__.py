"""``python -m specdec_gemma4_mtp costs ...``: what an assistant step costs; ``held-out
FOLDER``: a trained assistant's per-position acceptance on its held-out prompts (see
:mod:`specdec_gemma4_mtp.costs`)."""

from __future__ import annotations

import sys

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)

if __name__ == "__main__":
    import json

    argv = sys.argv[1:]
    if argv[:1] == ["costs"]:
        from .costs import main

        sys.exit(main(argv[1:]))
    if (
        argv[:1] == ["held-out"]
        and len(argv) in (2, 4)
        and (len(argv) == 2 or argv[2] == "--model")
    ):
        from .costs import measure_held_out

        model = argv[3] if len(argv) == 4 else None
        try:
            print(json.dumps(measure_held_out(argv[1], model=model), indent=1))
        except specdec.SpecdecError as exc:
            sys.exit(f"python -m specdec_gemma4_mtp held-out: error: {exc}")
        sys.exit(0)
    sys.exit(
        "usage: python -m specdec_gemma4_mtp costs [--model M --assistant A | --random-weights "
        "e2b] ...\n       python -m specdec_gemma4_mtp held-out ASSISTANT_FOLDER [--model M]"
    )
