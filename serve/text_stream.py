"""Token ids in, text increments out, cut at stop strings.

Text is re-decoded from all ids so far (a token may complete a multi-byte character or change how the
previous ones detokenize); an increment is released only when it cannot become part of a stop string:
the longest tail that is a prefix of some stop string is held back until the next tokens settle it.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, decode, stop: list[str]):
        self._decode, self._stop = decode, stop
        self.ids: list[int] = []
        self._sent = 0  # characters released
        self.stopped = False  # a stop string was found: the text is final, generation can end

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        self.ids += ids
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its remaining bytes
            return ""
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            return self._release(text, cut)
        return self._release(text, len(text) - self._held_back(text))

    def flush(self) -> str:
        """The end of generation: everything not yet sent (no stop string can complete any more)."""
        if self.stopped:
            return ""
        text = self._decode(self.ids)
        return self._release(text, len(text))

    @property
    def sent(self) -> int:
        """Characters released so far."""
        return self._sent

    def starts(self, n: int) -> list[int]:
        """Where the text of each of the last n tokens starts (a character offset into the whole text)."""
        return [len(self._decode(self.ids[:k])) for k in range(len(self.ids) - n, len(self.ids))]

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._decode(self.ids)[: self._sent]

    def _release(self, text: str, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = text[self._sent:end], end
        return out

    def _first_stop(self, text: str) -> int | None:
        # Search from a little before what was sent: a stop string may straddle the boundary.
        start = max(0, self._sent - max((len(s) for s in self._stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of text that starts some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-n:]):
                    best = n
                    break
        return best
