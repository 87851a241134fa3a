"""``python -m specdec_qwen_mtp_gdn``: commit cost per strategy on a tiny hybrid model (JSON lines)."""

from .costs import main

main()
