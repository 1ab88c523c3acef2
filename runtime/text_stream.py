"""Token ids in, text increments out, cut at stop strings.

A token may complete a multi-byte character or change how the token before it detokenizes, so text is not a
concatenation of per-token strings. Re-decoding every id at every round would be right but costs O(length)
per round; instead only a window is decoded (vLLM's and TGI's incremental detokenization): it starts at
`_prefix`, an earlier point where the text was whole, and the text of the window's settled part
(`_prefix`..`_read`) is subtracted, so that what decoding a sequence's first token does to it (SentencePiece
drops its leading space, a word tokenizer puts no separator before it) falls on text already known. The text
of ids[:k] is then `_read_chars + len(decode(ids[_prefix:k])) - len(decode(ids[_prefix:_read]))` for k >=
`_read`. A window that does not extend its settled part's text (a tokenizer for which the rule above fails)
falls back to decoding everything. One difference remains, in text that is broken anyway: SentencePiece's byte
fallback decodes a run of byte tokens that is not UTF-8 as one "\ufffd" per byte, and a run that starts
before the window is seen only in part, so a different number of "\ufffd" may stand for it.

Tokens are taken one at a time, as plain decode commits them, so what is released and where a stop string is
found do not depend on how many tokens a speculative round commits at once. After each token whose text is
whole (not ending in an incomplete UTF-8 character) the new text is searched for the stop strings; as in
vLLM, a stop string counts only once the output has more than `min_tokens` tokens (the stop ids are held
back as long), and a match that ended before that is passed over for good. Text is released only when it
cannot become part of a stop string: the longest tail that is a prefix of one is held back until the next
tokens settle it. The runtime ends an output at the token that completes a stop string
(runtime/stop_strings.py); the server and the CLI stream the text with the same rules.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, decode, stop: list[str], min_tokens: int = 0):
        self._decode, self._stop, self._min_tokens = decode, stop, min_tokens
        self.ids: list[int] = []
        self._text = ""  # the text of ids[:_read], whole (no incomplete character at its end)
        self._prefix = self._read = 0  # the window: ids[_prefix:], of which ids[_prefix:_read] are settled
        self._settled_text = ""  # decode(ids[_prefix:_read]) on its own
        self._last = (0, 0, "", 0)  # (_prefix, _read, _settled_text, len(_text)) before the last push
        self._searched = 0  # characters of _text searched for stop strings
        self._sent = 0  # characters released
        self.stopped = False  # a stop string was found: the text is final, generation can end

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send (nothing more once stopped)."""
        self._last = (self._prefix, self._read, self._settled_text, len(self._text))
        return "".join(self._push_one(int(t)) for t in ids)

    def _push_one(self, token: int) -> str:
        self.ids.append(token)
        if self.stopped:
            return ""
        window = self._decode(self.ids[self._prefix:])
        if window.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
            return ""
        if window.startswith(self._settled_text):
            self._text += window[len(self._settled_text):]
        else:
            self._text = self._decode(self.ids)
            self._last = (0, 0, "", 0)  # starts() decodes from the beginning too
        self._prefix, self._read = self._read, len(self.ids)
        self._settled_text = self._decode(self.ids[self._prefix:self._read])
        cut = self._new_stop()
        if cut is not None:
            self.stopped = True
            return self._release(self._text, cut)
        return self._release(self._text, len(self._text) - held_back(self._text, self._stop))

    def flush(self) -> str:
        """The end of generation: everything not yet sent (no stop string can complete any more)."""
        if self.stopped:
            return ""
        text = self._text + self._pending_text()
        return self._release(text, len(text))

    @property
    def sent(self) -> int:
        """Characters released so far."""
        return self._sent

    def starts(self, n: int) -> list[int]:
        """Where the text of each of the last n tokens starts (a character offset into the whole text: the
        length of the text of the tokens before it, an incomplete character counted as one "\ufffd")."""
        prefix, read, settled, read_chars = self._last
        first = len(self.ids) - n
        if first < read:  # tokens from before the last push: the window no longer reaches them
            prefix, read, settled, read_chars = 0, 0, "", 0
        return [read_chars + len(self._decode(self.ids[prefix:k])) - len(settled) for k in range(first, len(self.ids))]

    @property
    def text(self) -> str:
        """All text released so far."""
        return (self._text + self._pending_text())[: self._sent]

    def _pending_text(self) -> str:
        """The text of the tokens after _read (may end in an incomplete character)."""
        return self._decode(self.ids[self._prefix:])[len(self._settled_text):] if len(self.ids) > self._read else ""

    def _release(self, text: str, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = text[self._sent:end], end
        return out

    def _new_stop(self) -> int | None:
        """Where the first stop string that ends in the text added since the last search starts (None: none, or
        the output is too short for one to count)."""
        hits = [i for i in (self._text.find(s, max(0, self._searched - len(s) + 1)) for s in self._stop) if i >= 0]
        self._searched = len(self._text)
        return min(hits) if hits and len(self.ids) > self._min_tokens else None


def held_back(text: str, stop: list[str]) -> int:
    """Length of the longest tail of text that starts some stop string (it may yet become one)."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
