"""Incremental detokenization with stop strings that are safe to stream.

Text is decoded over a small window of recent tokens, and only once the window decodes to more
text than before and does not end in a partial UTF-8 character (``\\ufffd``): byte-level BPE
splits one character over several tokens, and a token's leading space depends on the token
before it. The window starts in the prompt, so the first generated token gets its space right.

Stop strings: after each token, the new tail of the text is searched for any stop string; the
text is cut there (keeping the stop string only with ``include_stop_str_in_output``). While
streaming, a tail of the text that could still become a stop string is held back, so no text is
ever sent that a later stop string would have removed.
"""

from __future__ import annotations

from typing import Any, Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded together with the first generated ones


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self._sent = 0  # characters of ``text`` already handed out

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Decode one more token; returns the stop string it completed, if any (text cut there)."""
        self._ids.append(token_id)
        if self.tokenizer is None:
            return None
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # wait for the rest of a multi-byte character
        before = len(self.text)
        self.text += full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._cut_at_stop(before) if check_stop else None

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet, minus a tail that could still grow into a stop string."""
        end = len(self.text) if finished else len(self.text) - self._stop_prefix_len()
        new = self.text[self._sent : max(end, self._sent)]
        self._sent += len(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _cut_at_stop(self, new_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            # a stop string may start up to len(stop) - 1 characters before the new text
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self.include_stop else at]
        return stop

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
