"""Incremental detokenisation with stop strings.

mlx-lm's streaming detokenizers already hold back incomplete UTF-8 sequences (a multi-byte character
split over tokens is never emitted half-way). On top of that this holds back any text tail that could
still turn into a stop string, so a stop string never reaches the caller.
"""

from __future__ import annotations

import copy
import functools


@functools.lru_cache(maxsize=None)
def _keeping_leading_space(cls: type) -> type:
    """A subclass of mlx-lm's detokenizer class ``cls`` that keeps the first token's leading space."""
    return type(cls.__name__, (cls,), {"_maybe_trim_space": lambda self, text: text})


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False):
        # The wrapper builds its detokenizer's token map once; copies share it and keep own state.
        base = tokenizer._detokenizer
        self._detok = copy.copy(base)
        self._detok.reset()
        if hasattr(self._detok, "_maybe_trim_space"):
            # mlx-lm's BPE detokenizer drops the first token's leading space (" Paris" -> "Paris");
            # a completion must keep it, so the text equals tokenizer.decode(token_ids).
            self._detok.__class__ = _keeping_leading_space(type(base))
        self.stop = stop
        self.include_stop = include_stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.emitted = 0  # characters of text already handed out
        self.stopped = False
        self.matched_stop: str | None = None
        self.text = ""  # final text (after stop truncation), valid once stopped or finished

    def add(self, token: int) -> str:
        """Feed one token; return the new text that is safe to emit."""
        self._detok.add_token(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flush what is held back (at end of generation)."""
        if not self.stopped:
            self._detok.finalize()
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.stopped:
            return ""
        text = self._detok.text
        if self.stop:
            # Search only where a new match can start.
            start = max(0, self.emitted - self._max_stop + 1)
            best = -1
            best_stop = ""
            for s in self.stop:
                pos = text.find(s, start)
                if pos != -1 and (best == -1 or pos < best):
                    best, best_stop = pos, s
            if best != -1:
                end = best + len(best_stop) if self.include_stop else best
                self.stopped = True
                self.matched_stop = best_stop
                self.text = text[:end]
                out = text[self.emitted : end] if end > self.emitted else ""
                self.emitted = max(self.emitted, end)
                return out
            if not final:
                safe = len(text) - self._held_back(text)
            else:
                safe = len(text)
        else:
            safe = len(text)
        out = text[self.emitted : safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        self.text = text
        return out

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
