"""The admission window (``serve/admission.py``): after a step that finished a request, the engine process
takes the next request into the very next step when it arrives while the device still runs the step in
flight, and never holds the device back for it."""

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from autodeploy.sampling_params import SamplingParams
from autodeploy.serve.admission import MARGIN_SECONDS, MIN_SAMPLES, AdmissionWindow
from autodeploy.serve.engine import EngineStats
from autodeploy.serve.engine_process import EngineLoop
from autodeploy.serve.engine_protocol import AddRequest, Codec, Command, Event, Shutdown, StepOutputs
from autodeploy.serve.outputs import RequestOutput


def _timings(end: float, waited: float, launch: float = 0.001) -> SimpleNamespace:
    return SimpleNamespace(last_wait_end=end, last_wait_seconds=waited, launch_seconds=launch)


def test_the_deadline_is_the_predicted_end_of_the_step_in_flight_less_the_longest_launch():
    window = AdmissionWindow(max_wait_seconds=10.0)
    base = time.perf_counter()
    ends = [base + 0.010 * i for i in range(MIN_SAMPLES + 1)]  # the device ran a step every 10 ms
    for i, end in enumerate(ends):
        assert window.deadline() is None  # not before MIN_SAMPLES device times
        window.observe(_timings(end, waited=0.004, launch=0.002 if i == 2 else 0.001))
    assert window.deadline() == pytest.approx(ends[-1] + 0.010 - 0.002 - MARGIN_SECONDS)


def test_the_shortest_recent_step_predicts_the_end():
    window = AdmissionWindow(max_wait_seconds=10.0)
    end = time.perf_counter()
    for step in (0.012, 0.010, 0.015, 0.011, 0.013):
        end += step
        window.observe(_timings(end, waited=0.004))
    assert window.deadline() == pytest.approx(end + 0.010 - 0.001 - MARGIN_SECONDS)


def test_no_window_after_a_step_the_host_did_not_wait_for_or_did_not_resolve():
    window = AdmissionWindow(max_wait_seconds=10.0)
    end = time.perf_counter()
    for _ in range(MIN_SAMPLES + 1):
        end += 0.01
        window.observe(_timings(end, waited=0.004))
    assert window.deadline() is not None
    window.observe(_timings(end + 0.01, waited=0.0))  # the results were there: the device may be idle
    assert window.deadline() is None
    window.observe(_timings(end + 0.02, waited=0.004))  # one wait again: no device time from it yet...
    assert window.deadline() is not None  # ...but the older ones predict
    window.observe(_timings(end + 0.02, waited=0.004))  # the same wait again: nothing resolved this step
    assert window.deadline() is None


def test_the_wait_is_bounded_by_the_setting():
    window = AdmissionWindow(max_wait_seconds=0.002)
    end = time.perf_counter()
    for _ in range(MIN_SAMPLES + 1):
        end += 1.0  # long steps
        window.observe(_timings(end, waited=0.5))
    before = time.perf_counter()
    assert window.deadline() <= time.perf_counter() + 0.002
    assert window.deadline() >= before + 0.002 - 1e-3


@pytest.mark.parametrize("finished, in_flight, waiting, expected", [
    (1, True, [], True), (0, True, [], False), (1, False, [], False), (1, True, ["queued"], False)])
def test_it_opens_only_for_free_slots_with_a_step_in_flight_and_nothing_waiting(finished, in_flight, waiting,
                                                                                 expected):
    engine = SimpleNamespace(has_step_in_flight=in_flight, scheduler=SimpleNamespace(waiting=waiting))
    assert AdmissionWindow(0.01).should_open(engine, finished) is expected
    assert AdmissionWindow(0.0).should_open(engine, finished) is False


class _DeviceEngine:
    """An engine with overlap on a simulated device: ``step()`` admits what waits, queues a step of
    ``STEP`` seconds behind the one in flight, then waits for the one in flight. Request r0's last token
    is reported by the ``step()`` that launched step ``FINISH`` (0-based; the token came from the one before)."""

    STEP = 0.04
    FINISH = MIN_SAMPLES + 4

    def __init__(self, admission_wait_ms: float):
        self.config = SimpleNamespace(admission_wait_ms=admission_wait_ms)
        self.scheduler = SimpleNamespace(waiting=[])
        self.admitted: list[list[str]] = []  # per launched step
        self.launch_seconds, self.last_wait_end, self.last_wait_seconds = 0.001, 0.0, 0.0
        self._device_free, self._in_flight_end = time.perf_counter(), None
        self.idle_device_seconds = 0.0

    has_step_in_flight = True

    def has_unfinished_requests(self) -> bool:
        return True

    def add_request(self, request_id, prompt, params, arrival_time) -> None:
        self.scheduler.waiting.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 1, 0, 0, 0, 0)

    def step(self) -> list[RequestOutput]:
        self.admitted.append(list(self.scheduler.waiting))
        self.scheduler.waiting.clear()
        launched = time.perf_counter() + self.launch_seconds
        self.idle_device_seconds += max(0.0, launched - self._device_free)
        self._device_free = max(launched, self._device_free) + self.STEP
        if self._in_flight_end is not None:
            begun = time.perf_counter()
            time.sleep(max(0.0, self._in_flight_end - begun))
            self.last_wait_end = time.perf_counter()
            self.last_wait_seconds = self.last_wait_end - begun
        self._in_flight_end = self._device_free
        return [RequestOutput("r0", (1,), (), True)] if len(self.admitted) == self.FINISH + 1 else []


def _run_closed_loop(admission_wait_ms: float) -> _DeviceEngine:
    """The loop with a client that sends its next request 15 ms after r0's last output reaches it."""
    engine = _DeviceEngine(admission_wait_ms)
    context = zmq.Context()
    api_commands, api_events = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    api_commands.bind("inproc://commands")
    api_events.bind("inproc://events")
    commands, events = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    commands.connect("inproc://commands")
    events.connect("inproc://events")
    loop = EngineLoop(engine, commands, events, Codec(Command))
    thread = threading.Thread(target=loop.run)
    thread.start()
    client = Codec(Event)
    try:
        while not any(out.finished for out in client.decode(api_events.recv()).outputs):
            pass
        time.sleep(0.015)
        api_commands.send(client.encode(AddRequest("r1", [1, 2], SamplingParams(), time.monotonic())))
        deadline = time.monotonic() + 5
        while not any("r1" in step for step in engine.admitted):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        api_commands.send(client.encode(Shutdown()))
        thread.join(5)
        for socket in (api_commands, api_events, commands, events):
            socket.close(0)
        context.term()
    return engine


def _step_of(engine: _DeviceEngine, request_id: str) -> int:
    return next(i for i, ids in enumerate(engine.admitted) if request_id in ids)


def test_a_request_arriving_inside_the_window_joins_the_next_step():
    engine = _run_closed_loop(admission_wait_ms=100)
    # step FINISH was in flight when r0's end was sent: r1 joins the step after it
    assert _step_of(engine, "r1") == engine.FINISH + 1
    assert engine.idle_device_seconds < 0.01  # the wait never left the device without a queued step


def test_without_the_window_it_waits_a_step_more():
    engine = _run_closed_loop(admission_wait_ms=0)
    assert _step_of(engine, "r1") == engine.FINISH + 2


def test_the_flag_reaches_the_engine_config_and_bad_values_are_refused(capsys):
    import yaml

    from autodeploy.cli import main
    from autodeploy.serve.startup import ServeSettings, engine_config

    assert main(["serve", "ckpt", "--print_config", "--admission_wait_ms", "8"]) == 0, capsys.readouterr().err
    settings = yaml.safe_load(capsys.readouterr().out)
    assert settings["admission_wait_ms"] == 8
    assert engine_config(ServeSettings(admission_wait_ms=8)).admission_wait_ms == 8
    assert main(["serve", "ckpt", "--print_config", "--admission_wait_ms", "-1"]) == 2
    assert "admission_wait_ms" in capsys.readouterr().err
