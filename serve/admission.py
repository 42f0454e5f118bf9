"""The admission window: after a step that finished a request, the engine process waits for the next
request for as long as the device still has queued work, so that the request joins the next step.

Why: clients in a closed loop (chat front ends, agents, benchmark loops) send their next request as soon as
a response ends. With overlap (``engine.py``), by the time a step's outputs leave the engine the step
after it is already running and the loop would schedule the one after that at once: a request that
arrives a few milliseconds later (the response's trip to the client and the new request's trip back)
misses it and waits a whole step more, and its slot in the batch stays empty for that step. The host
has nothing else to do meanwhile: the device is busy with the step in flight, and scheduling the next
one takes a fraction of a step.

How long: until the step in flight is predicted to end, less the time the host takes to schedule and
launch a step. Both come from the engine's own timings (``Engine.last_wait_end``,
``last_wait_seconds``, ``launch_seconds``): when the host had to wait for a step's results, the device
ran without a gap, so the time between two such waits is one step's device time. The prediction takes
the shortest recent step and the longest recent launch, so that a wrong guess shortens the window rather
than leaving the device idle, and the window never opens without a measured history, after a step the
host did not wait for (the device may already be idle), or while requests are waiting already (the next
step has work for the free slot). ``--admission_wait_ms`` bounds it (0: off).
"""

from __future__ import annotations

import time
from collections import deque

HISTORY = 8  # recent steps whose device times and launch times the prediction takes
MIN_SAMPLES = 4  # no window before this many device times are measured
DEVICE_BUSY_SECONDS = 1e-4  # a wait this long means the device was still running the step
MARGIN_SECONDS = 5e-4  # launched this long before the predicted end at the latest


class AdmissionWindow:
    """Device and launch times of the engine's recent steps, and the deadline they give."""

    def __init__(self, max_wait_seconds: float):
        self.max_wait_seconds = max_wait_seconds
        self._durations: deque[float] = deque(maxlen=HISTORY)
        self._launches: deque[float] = deque(maxlen=HISTORY)
        self._last_end: float | None = None  # when the device finished the last step the host waited for
        self._seen_end = 0.0
        self.opened = self.admitted = 0  # windows opened, requests that arrived inside one

    def observe(self, engine) -> None:
        """After each ``engine.step()``: record what it measured."""
        end, waited = engine.last_wait_end, engine.last_wait_seconds
        self._launches.append(engine.launch_seconds)
        if end == self._seen_end:  # nothing resolved in this step: the device timing is unknown
            self._last_end = None
            return
        self._seen_end = end
        if waited < DEVICE_BUSY_SECONDS:  # the results were there already: the device may have idled
            self._last_end = None
            return
        if self._last_end is not None:
            self._durations.append(end - self._last_end)
        self._last_end = end

    def deadline(self) -> float | None:
        """When the next step must be scheduled (``time.perf_counter()``), or None: no window now."""
        if self._last_end is None or len(self._durations) < MIN_SAMPLES:
            return None
        predicted_end = self._last_end + min(self._durations)
        latest = predicted_end - max(self._launches) - MARGIN_SECONDS
        return min(latest, time.perf_counter() + self.max_wait_seconds)

    def should_open(self, engine, finished: int) -> bool:
        """Requests finished in the outputs just sent, a step is in flight and nothing waits to take their slots."""
        return (self.max_wait_seconds > 0 and finished > 0 and engine.has_step_in_flight
                and not engine.scheduler.waiting)
