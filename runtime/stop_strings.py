"""Where a round's tokens end: at a stop id, a stop string, or the token limit.

A speculative round commits several tokens at once, so a sequence may run past the point where plain decode,
one token per round, would have stopped. `cut_round` walks a round's tokens in order and stops at the token
plain decode stops at, so speculative and plain output stay equal with stop strings (OpenAI's and vLLM's
`stop`) as with stop ids. The strings are matched on the decoded text by a TextStream, which takes tokens one
at a time and applies plain decode's rules (runtime/text_stream.py).
"""
from __future__ import annotations

from ..errors import GenerationError
from .text_stream import TextStream

MAX_STOP_STRINGS = 16


def check_stop(stop) -> list[str]:
    """A list of non-empty strings (a single string is one), or None / [] for none."""
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise GenerationError(f"stop must be a non-empty string or a list of them, not {stop!r}")
    if len(stop) > MAX_STOP_STRINGS:
        raise GenerationError(f"at most {MAX_STOP_STRINGS} stop strings, not {len(stop)}")
    return list(stop)


def stop_strings_for(tokenizer, stop, min_new_tokens: int = 0) -> TextStream | None:
    """A fresh text stream that watches one output for `stop` strings (None for none); GenerationError for bad
    ones or for a bundle without a tokenizer."""
    stop = check_stop(stop)
    if not stop:
        return None
    if tokenizer is None:
        raise GenerationError("stop strings need the bundle's tokenizer (tokenizer/tokenizer.json and the tokenizers "
                              "package: pip install 'specedge[text]'); stop ids work without it")
    return TextStream(tokenizer.decode, stop, min_new_tokens)


def output_text(tokenizer, tokens: list[int], stop_strings: TextStream | None) -> str | None:
    """A finished output's text: the text before the stop string that ended it, else its tokens decoded (None:
    no tokenizer)."""
    if stop_strings is not None and stop_strings.stopped:
        return stop_strings.text
    return tokenizer.decode(tokens) if tokenizer else None


def cut_round(new: list[int], emitted: int, max_new_tokens: int, stop_ids: set[int],
              text: TextStream | None = None) -> tuple[list[int], str]:
    """A round's committed tokens, cut after the first stop id, completed stop string (`text` has taken every
    earlier token of the output) or the token limit, and why the sequence ends ("" when it goes on).
    `emitted`: output tokens before this round."""
    for i, token in enumerate(new):
        if token in stop_ids:
            return new[: i + 1], "stop"
        if text is not None:
            text.push([token])
            if text.stopped:
                return new[: i + 1], "stop"
        if emitted + i + 1 >= max_new_tokens:
            return new[: i + 1], "max_new_tokens"
    return new, ""
