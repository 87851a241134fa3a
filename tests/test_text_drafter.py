"""A drafter that works on text: the line-copy example of docs/writing-plugins.md.

The classes below are quoted verbatim by the docs ("Drafters that work on text").
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import specdec
from specdec.testing import (
    ToyTokenizer,
    check_greedy_identity,
    make_tiny_model,
    plain_greedy,
    plugin_host,
)
from specdec.testing.toy_tokenizer import NEWLINE


class LineCopyDrafter(specdec.BaseDrafter):
    """When the current line's text appeared before, proposes the tokens that followed it."""

    name = "line_copy"

    def __init__(self, *, max_len: int = 8, min_chars: int = 4, window: int = 512) -> None:
        self.max_len, self.min_chars, self.window = max_len, min_chars, window

    def attach(self, model, tokenizer) -> None:
        # Called once by specdec.assemble: refuse a pipeline without a tokenizer there.
        if tokenizer is None:
            raise specdec.PolicyError("line_copy reads text: assemble with a tokenizer")

    def session(self, ctx: specdec.RequestContext) -> LineCopySession:
        return LineCopySession(ctx.tokenizer, self.max_len, self.min_chars, self.window)


class LineCopySession(specdec.BaseDrafterSession):
    def __init__(self, tokenizer, max_len: int, min_chars: int, window: int) -> None:
        self.tokenizer = tokenizer
        self.max_len, self.min_chars, self.window = max_len, min_chars, window

    def propose(self, history: Sequence[int], max_len: int) -> specdec.Draft | None:
        ids = list(history[-self.window :])
        text = self.tokenizer.decode(ids)  # the whole window at once, never token by token
        start = text.rfind("\n") + 1  # where the current line begins
        line = text[start:]
        if len(line) < self.min_chars:
            return None
        at = text.rfind(line, 0, start)  # the line's text, earlier in the window
        if at < 0:
            return None
        j = self.token_at(ids, text, at + len(line))  # the token right after that text
        if j is None or j >= len(ids):
            return None
        return specdec.Draft(tokens=ids[j : j + min(max_len, self.max_len)])

    def token_at(self, ids: list[int], text: str, pos: int) -> int | None:
        """The index of the token of ``ids`` that starts at character ``pos`` of ``text``
        (their decoding), or ``None`` when ``pos`` is inside a token."""
        for j in range(len(ids) + 1):
            prefix = self.tokenizer.decode(ids[:j])
            if prefix == text[:pos]:  # a prefix that ends inside a character ends in U+FFFD
                return j
            if len(prefix) > pos:
                return None
        return None


class LineCopyPlugin:
    @specdec.hookimpl
    def specdec_register_drafters(self, register):
        register("line_copy", LineCopyDrafter, description="copies what followed a line")


POLICY = specdec.Policy(drafters=("line_copy",))


def _line_prompt(model, tok):
    """A prompt whose last line repeats an earlier one, and on which the tiny model
    writes what followed it there: "\\n" + words, a continuation, "\\n" + the words
    again, the continuation replaced by what the model writes after that prompt until
    it is the same (the first candidate with drafts both accepted and rejected)."""
    for words in ("the cat sat ", "hello world ", "apples, pears ", "one two three "):
        head = [NEWLINE, *tok.encode(words)]
        cont = plain_greedy(model, head, 16)
        for _ in range(6):
            prompt = head + cont + head
            again = plain_greedy(model, prompt, 16)
            if again[:8] == cont[:8]:
                break
            cont = again
        st = specdec.assemble(model, tok, POLICY).generate(prompt, max_tokens=16).stats
        if 2 <= st.accepted < st.drafted:
            return prompt
    raise AssertionError("no candidate prompt gets line_copy's drafts accepted and rejected")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", vocab_size=64, seed=0)


def test_line_copy_keeps_greedy_identity(model):
    tok = ToyTokenizer()
    with plugin_host(LineCopyPlugin(), load_entry_points=False):
        prompt = _line_prompt(model, tok)
        totals = check_greedy_identity(model, POLICY, prompt, tokenizer=tok)
    assert 0 < totals["accepted"] < totals["drafted"]


def test_line_copy_needs_a_tokenizer(model):
    with plugin_host(LineCopyPlugin(), load_entry_points=False):
        with pytest.raises(specdec.PolicyError, match="assemble with a tokenizer"):
            specdec.assemble(model, None, POLICY)


def test_line_copy_proposes_the_tokens_after_the_earlier_line():
    tok = ToyTokenizer()
    s = LineCopyDrafter().session(specdec.testing.request_context([0], tokenizer=tok))
    history = tok.encode("the cat sat.\nthe dog ran.\nthe cat ")
    assert tok.decode(s.propose(history, 8).tokens) == "sat.\nthe"
    assert s.propose(tok.encode("abc\nthe"), 8) is None  # a line shorter than min_chars
    assert s.propose(tok.encode("the cat\nthe dog"), 8) is None  # never seen before


class _Utf8Bytes:
    """A byte-level tokenizer: one token per UTF-8 byte, decoded with replacement."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def test_token_positions_across_a_multibyte_character():
    tok = _Utf8Bytes()
    s = LineCopySession(tok, max_len=8, min_chars=4, window=512)
    ids = tok.encode("café au\ncafé ")  # "é" is two tokens
    text = tok.decode(ids)
    assert tok.decode(ids[:4]) == "caf\ufffd"  # one token of "é" alone: U+FFFD
    assert s.token_at(ids, text, 3) == 3 and s.token_at(ids, text, 4) == 5
    assert tok.decode(s.propose(ids, 8).tokens) == "au\ncafé"
