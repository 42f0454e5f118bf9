"""Stop strings found in one pass over the new text, whatever their number (Aho-Corasick).

The detokenizer asks two things after every token: did a stop string end in the new text, and how
long is the tail of the text that could still grow into one (held back while streaming)? Checking
each stop string against the text costs (stop strings x their length) per token, on the engine's
thread, for every other request too. A :class:`StopMatcher` is an automaton over the characters of
all stop strings: each new character costs one transition, and both answers are read off the
state. Built once per distinct stop list (cached; the server builds it on a worker thread before
the request reaches the engine) and shared by every sequence that uses it.
"""

from __future__ import annotations

import functools
from collections import deque


class StopMatcher:
    """The Aho-Corasick automaton of a set of stop strings. States are ints; 0 is the empty text."""

    def __init__(self, stops: tuple[str, ...]):
        goto: list[dict[str, int]] = [{}]
        depth, complete = [0], [False]
        for stop in stops:
            node = 0
            for char in stop:
                if char not in goto[node]:
                    goto[node][char] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    complete.append(False)
                node = goto[node][char]
            complete[node] = True
        self._goto, self._fail = goto, [0] * len(goto)
        self._ends = complete  # a stop string ends at this state (itself or through its fail chain)
        self._hold = [0] * len(goto)  # longest suffix that is a proper prefix of a stop string
        self._link(depth)

    def _link(self, depth: list[int]) -> None:
        goto, fail, ends, hold = self._goto, self._fail, self._ends, self._hold
        queue = deque(goto[0].values())
        for child in queue:
            hold[child] = depth[child] if goto[child] else 0
        while queue:
            node = queue.popleft()
            for char, child in goto[node].items():
                f = fail[node]
                while f and char not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(char, 0)
                ends[child] = ends[child] or ends[fail[child]]
                hold[child] = depth[child] if goto[child] else hold[fail[child]]
                queue.append(child)

    def advance(self, state: int, text: str) -> tuple[int, bool]:
        """The state after ``text``, and whether a stop string ended inside it."""
        goto, fail, ends = self._goto, self._fail, self._ends
        ended = False
        for char in text:
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            ended = ended or ends[state]
        return state, ended

    def held(self, state: int) -> int:
        """Characters at the end of the text that could still become a stop string."""
        return self._hold[state]


@functools.lru_cache(maxsize=256)
def stop_matcher(stops: tuple[str, ...]) -> StopMatcher:
    return StopMatcher(stops)
