"""Incremental detokenization with stop strings that are safe to stream.

Text is decoded over a small window of recent tokens, and only once the window decodes to more
text than before and does not end in a partial UTF-8 character (``\\ufffd``): byte-level BPE
splits one character over several tokens, and a token's leading space depends on the token
before it. The window starts in the prompt, so the first generated token gets its space right.

Stop strings: after each token, the new text goes through the stop strings' automaton
(``stop_strings``: one step per character, however many stop strings there are); when one ends
there, the text is cut where the earliest one starts (keeping the stop string only with
``include_stop_str_in_output``). While streaming, a tail of the text that could still become a stop
string is held back (read off the automaton's state), so no text is ever sent that a later stop
string would have removed.
"""

from __future__ import annotations

from typing import Any, Sequence

from .stop_strings import stop_matcher

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
        self._stops = stop_matcher(tuple(stop)) if stop else None
        self._stop_state = 0
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
        new = full[len(prefix) :]
        self.text += new
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._stops is None:
            return None
        self._stop_state, ended = self._stops.advance(self._stop_state, new)
        return self._cut_at_stop(before) if ended and check_stop else None

    def add_tokens(self, token_ids: Sequence[int], num_before: int, min_tokens: int,
                   ends_with_stop_token: bool = False) -> tuple[int, str] | None:
        """Decode the generated tokens that follow the first ``num_before``. With ``ends_with_stop_token``
        the last one (EOS or a stop token id) stays out of the text unless the request asked to include
        stops. A stop string is looked for once ``min_tokens`` are out; when one completes, returns
        (generated tokens kept: those up to the one that completed it, the stop string)."""
        if ends_with_stop_token and not self.include_stop and token_ids:
            token_ids = token_ids[:-1]
        for i, token in enumerate(token_ids):
            produced = num_before + i + 1
            stop = self.add_token(token, check_stop=produced >= min_tokens)
            if stop is not None:
                return produced, stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not handed out yet, minus a tail that could still grow into a stop string."""
        held = self._stops.held(self._stop_state) if self._stops is not None and not finished else 0
        end = len(self.text) - held
        new = self.text[self._sent : max(end, self._sent)]
        self._sent += len(new)
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _cut_at_stop(self, new_from: int) -> str | None:
        """Where the earliest stop string in the new text starts (only run once one has ended there)."""
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
