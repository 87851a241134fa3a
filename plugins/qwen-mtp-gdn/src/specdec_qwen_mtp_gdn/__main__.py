"""``python -m specdec_qwen_mtp_gdn [--arch ...]``: commit cost per strategy on a tiny hybrid
model (JSON lines); ``python -m specdec_qwen_mtp_gdn held-out FOLDER [--model M] [--depth K]
[--head H] [--max-tokens N]``: a head ``specdec train-head`` wrote, its per-position
acceptance on the prompts its training held out (:func:`specdec_train.held_out_acceptance`,
at a fixed depth)."""

from __future__ import annotations

import sys

import specdec  # noqa: F401  (first: it binds the fast BLAS before mlx is loaded)


def held_out(argv: list[str]) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m specdec_qwen_mtp_gdn held-out")
    ap.add_argument("folder", help="the folder specdec train-head wrote")
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--depth", type=int, default=3, help="drafts per round, fixed (default: 3)")
    ap.add_argument("--head", default="exact", help="the qwen_mtp head option (default: exact)")
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    if a.depth < 1 or a.max_tokens < 1:
        ap.error(f"--depth and --max-tokens must be >= 1, got {a.depth} and {a.max_tokens}")
    pol = specdec.load_policy("mtp").with_options(
        "qwen_mtp", mtp_path=a.folder, depth=a.depth, max_depth=a.depth, adaptive=False, head=a.head
    )
    import specdec_train

    try:
        res = specdec_train.held_out_acceptance(
            a.folder, pol, "qwen_mtp", model=a.model, max_tokens=a.max_tokens
        )
    except specdec.SpecdecError as exc:
        ap.error(str(exc))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["held-out"]:
        sys.exit(held_out(sys.argv[2:]))
    from .costs import main

    main()
