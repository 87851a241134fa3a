"""A character-level toy tokenizer for tiny models (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;:!?\n0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ()"


class ToyTokenizer:
    """Token ``i`` is the character ``ALPHABET[i % len(ALPHABET)]``; ``eos_token_ids`` is configurable.

    Enough for the pipeline: ``encode``, ``decode``, ``eos_token_ids``, ``vocab_size``.
    """

    def __init__(self, vocab_size: int = 64, eos_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = None

    def encode(self, text: str) -> list[int]:
        """Characters to ids (characters outside the alphabet are an error)."""
        out = []
        for ch in text:
            i = ALPHABET.find(ch)
            if i < 0 or i >= self.vocab_size:
                raise ValueError(f"ToyTokenizer cannot encode {ch!r}")
            out.append(i)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to characters."""
        return "".join(ALPHABET[int(i) % len(ALPHABET)] for i in ids)
