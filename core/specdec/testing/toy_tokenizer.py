"""A character-level toy tokenizer for tiny models (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Sequence

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,;:!?\n0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ()"

#: The id of ``"\n"`` (33): where a line ends in a test's token ids.
NEWLINE = ALPHABET.index("\n")
#: The id of ``" "`` (26).
SPACE = ALPHABET.index(" ")


class ToyTokenizer:
    """Token ``i`` is the character ``ALPHABET[i % len(ALPHABET)]``; ``eos_token_ids`` is configurable.

    Enough for the pipeline: ``encode``, ``decode``, ``eos_token_ids``, ``vocab_size``.
    One token is one character, so text positions are token positions (a real
    tokenizer's are not). The alphabet, by id (72 characters)::

        0-25    a-z
        26      " "  (space, SPACE)
        27-32   .  ,  ;  :  !  ?
        33      "\\n" (newline, NEWLINE)
        34-43   0-9
        44-69   A-Z
        70, 71  (  )

    ``encode`` accepts only ids below ``vocab_size`` (the default 64 ends at ``T``,
    id 63); ``decode`` takes any id, modulo 72.
    """

    def __init__(self, vocab_size: int = 64, eos_token_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        self.chat_template = None

    def id_of(self, char: str) -> int:
        """The id of the one character ``char``.

        Raises:
            ValueError: ``char`` is not one character of the alphabet below
                ``vocab_size`` (the message names it and the characters there are).
        """
        i = ALPHABET.find(char) if isinstance(char, str) and len(char) == 1 else -1
        if i < 0 or i >= self.vocab_size:
            raise ValueError(
                f"ToyTokenizer(vocab_size={self.vocab_size}) cannot encode {char!r}: its "
                f"vocabulary is the characters {ALPHABET[: self.vocab_size]!r}"
            )
        return i

    def encode(self, text: str) -> list[int]:
        """Characters to ids (a character outside the vocabulary is a ``ValueError``)."""
        return [self.id_of(ch) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to characters."""
        return "".join(ALPHABET[int(i) % len(ALPHABET)] for i in ids)
