"""What a request's stream shows: committed tokens turned into responses.

One :class:`Emitter` per request does the detokenizing, stop strings, stop tokens
and ``max_tokens``; the single-request and batch drivers both push each round's
committed tokens into it and hand on the :class:`StreamResponse` objects it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from .stats import Stats

__all__ = ["Emitter", "GenerationResult", "StreamResponse"]


@attrs.frozen
class StreamResponse:
    """One committed token.

    Attributes:
        text: the new text segment (incrementally detokenized; may be empty).
        token: the token id.
        from_draft: whether the token was a drafted token that the target accepted.
        position: absolute position of the token.
        finish_reason: ``None``, or ``"stop"``/``"length"`` on the last response.
        stats: the request's :class:`Stats` (final on the last response).
        is_stop_token: the last response of a stream ended by a stop token carries
            that token here; it is not part of the output (as in mlx-lm).
        logprob: the token's log-probability under the target (a request with
            ``logprobs``; else ``None``).
        top_logprobs: the most likely tokens at this position, ``((id, logprob), ...)``
            most likely first (``logprobs`` of them; ``None`` without ``logprobs``).
        stop_string: on the last response of a stream ended by a stop string, that
            string (the one found first in the text; of two found at the same place,
            the one listed first); ``None`` otherwise. Since 0.3.3.
    """

    text: str
    token: int
    from_draft: bool
    position: int
    finish_reason: str | None = None
    stats: Stats | None = None
    is_stop_token: bool = False
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    stop_string: str | None = None


@attrs.frozen
class GenerationResult:
    """The whole output of :meth:`Pipeline.generate` (``tokens`` excludes a final stop token)."""

    text: str
    tokens: list
    stats: Stats
    finish_reason: str | None


class _NaiveDetokenizer:
    """Incremental text for tokenizers without mlx-lm's streaming detokenizer."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.last_segment = ""

    def reset(self) -> None:
        self.tokens, self.text, self.last_segment = [], "", ""

    def add_token(self, tok: int) -> None:
        self.tokens.append(tok)
        if self.tokenizer is None:
            self.last_segment = ""
            return
        new = self.tokenizer.decode(self.tokens)
        if new.endswith("\ufffd"):  # incomplete UTF-8: wait for more bytes
            self.last_segment = ""
            return
        self.last_segment, self.text = new[len(self.text) :], new

    def finalize(self) -> None:
        if self.tokenizer is None:
            self.last_segment = ""
            return
        new = self.tokenizer.decode(self.tokens)
        self.last_segment, self.text = new[len(self.text) :], new


def detokenizer(tokenizer: Any) -> Any:
    """A fresh incremental detokenizer: mlx-lm's streaming one when the tokenizer has it."""
    detok = getattr(tokenizer, "detokenizer", None) if tokenizer is not None else None
    if detok is None:
        detok = _NaiveDetokenizer(tokenizer)
    detok.reset()
    return detok


class Emitter:
    """A request's output side: ``push`` the committed tokens of a round, get responses.

    Args:
        tokenizer: for the text (``None``: empty text segments).
        stop_ids: token ids that end the stream (not emitted: the last response carries
            the token with ``is_stop_token``).
        stop_strings: strings that end the stream (text is held back while it could
            begin one; the output is cut before it).
        max_tokens: the exact number of tokens emitted at most.
        stats: the request's statistics (the responses carry them).
        on_end: called with the finish reason before the last response is made, to
            complete ``stats``.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop_ids: frozenset[int],
        stop_strings: Sequence[str],
        max_tokens: int,
        stats: Stats,
        on_end: Callable[[str], None],
    ):
        self.detok = detokenizer(tokenizer)
        self.stop_ids = stop_ids
        self.stop_strings = tuple(stop_strings)
        self.max_tokens = max_tokens
        self.stats = stats
        self.on_end = on_end
        #: tokens emitted so far (a stop token is not counted).
        self.n_out = 0
        #: the text emitted so far.
        self.text = ""
        #: whether the stream has ended (the last response was returned).
        self.done = False
        self._pending = ""

    @property
    def remaining(self) -> int:
        """Tokens the stream may still emit."""
        return self.max_tokens - self.n_out

    def push(
        self,
        tokens: Sequence[int],
        n_drafted: int,
        position: int,
        logprobs: Sequence[tuple[float, tuple[tuple[int, float], ...]]] | None = None,
    ) -> list[StreamResponse]:
        """Responses for the tokens a round committed at ``position`` on; the first
        ``n_drafted`` of them were accepted drafts; ``logprobs``: each token's
        ``(logprob, top_logprobs)`` (:func:`specdec.round.token_logprobs`). After the
        last response (``finish_reason`` set) :attr:`done` is True and the rest of
        ``tokens`` is dropped."""
        out = self._push(tokens, n_drafted, position)
        if logprobs is None:
            return out
        return [
            attrs.evolve(
                r,
                logprob=logprobs[r.position - position][0],
                top_logprobs=logprobs[r.position - position][1],
            )
            for r in out
        ]

    def _push(self, tokens: Sequence[int], n_drafted: int, position: int) -> list[StreamResponse]:
        out: list[StreamResponse] = []
        detok = self.detok
        for i, tok in enumerate(tokens):
            drafted, pos = i < n_drafted, position + i
            if tok in self.stop_ids:
                detok.finalize()
                out.append(self._end(detok.last_segment, tok, drafted, "stop", pos, True))
                return out
            detok.add_token(tok)
            seg = detok.last_segment
            self.n_out += 1
            hit: tuple[int, str] | None = None
            if self.stop_strings:
                # Text that could begin a stop string is held back until it cannot.
                buf = self._pending + seg
                hit = self._find_stop(buf)
                if hit is not None:
                    out.append(self._end(buf[: hit[0]], tok, drafted, "stop", pos, stop=hit[1]))
                    return out
                hold = max(len(s) for s in self.stop_strings) - 1
                cut = max(0, len(buf) - hold)
                seg, self._pending = buf[:cut], buf[cut:]
            if self.n_out >= self.max_tokens:
                detok.finalize()
                seg += detok.last_segment
                if self.stop_strings:
                    tail = self._pending + detok.last_segment
                    hit = self._find_stop(tail)
                    seg = seg[: len(seg) - len(detok.last_segment)] + (
                        tail[: hit[0]] if hit is not None else tail
                    )
                    self._pending = ""
                reason = "stop" if hit is not None else "length"
                out.append(self._end(seg, tok, drafted, reason, pos, stop=hit[1] if hit else None))
                return out
            self.text += seg
            out.append(
                StreamResponse(
                    text=seg, token=tok, from_draft=drafted, position=pos, stats=self.stats
                )
            )
        return out

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string in ``text`` begins, and which it is (of two
        beginning at the same place, the one listed first); ``None``: none is there."""
        best: tuple[int, str] | None = None
        for s in self.stop_strings:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _end(
        self,
        seg: str,
        tok: int,
        drafted: bool,
        reason: str,
        pos: int,
        stop_token: bool = False,
        stop: str | None = None,
    ) -> StreamResponse:
        self.done = True
        self.stats.generation_tokens = self.n_out
        self.stats.finish_reason = reason
        self.on_end(reason)
        self.text += seg
        return StreamResponse(
            text=seg,
            token=tok,
            from_draft=drafted,
            position=pos,
            finish_reason=reason,
            stats=self.stats,
            is_stop_token=stop_token,
            stop_string=stop,
        )
