"""A stream whose reader fell behind takes its queued deltas as one (``AUTODEPLOY_COALESCE_STREAMS=1``,
``async_engine.coalesce``): text, tokens and logprobs joined in order, the last finish state; an exception or an
error report behind them still arrives, after them; off, every delta arrives alone."""

import asyncio
import json

import httpx
import pytest

from autodeploy.sampling_params import SamplingParams
from autodeploy.serve import async_engine
from autodeploy.serve.async_engine import EngineFrontEnd, RequestFailedError
from autodeploy.serve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from conftest import serving


class _Scripted(EngineFrontEnd):
    """Delivers a scripted list of items to a request's stream at once, as a receiver thread does when the
    event loop is late."""

    is_running = True

    def __init__(self, script):
        super().__init__()
        self.script = script

    def check_request(self, prompt_token_ids, params) -> None:
        pass

    def _submit(self, request_id, prompt_token_ids, params, arrival_time) -> None:
        self._deliver_all([(request_id, item) for item in self.script])

    def _cancel(self, request_id) -> None:
        pass


def _delta(*tokens: int, finish: str | None = None, error: str | None = None, logprobs: bool = False):
    entries = tuple(TokenLogprob(t, -0.5 * t) for t in tokens) if logprobs else None
    choice = CompletionOutput(0, "".join(chr(96 + t) for t in tokens), tokens, entries, finish)
    return RequestOutput("r", (7, 8), (choice,), finish is not None or error is not None, error=error)


def _read(script, on: bool) -> tuple[list[RequestOutput], BaseException | None]:
    async def run():
        got = []
        try:
            async for out in _Scripted(script).generate("r", (7, 8), SamplingParams()):
                got.append(out)
        except Exception as exc:  # noqa: BLE001 (the test looks at it)
            return got, exc
        return got, None

    async_engine_flag = async_engine.COALESCE_STREAMS
    async_engine.COALESCE_STREAMS = on
    try:
        return asyncio.run(run())
    finally:
        async_engine.COALESCE_STREAMS = async_engine_flag


def test_queued_deltas_arrive_as_one():
    got, error = _read([_delta(1, logprobs=True), _delta(2, 3, logprobs=True), _delta(4, finish="length",
                                                                                       logprobs=True)], on=True)
    assert error is None and len(got) == 1
    (choice,) = got[0].outputs
    assert (choice.text, choice.token_ids, choice.finish_reason) == ("abcd", (1, 2, 3, 4), "length")
    assert [e.token_id for e in choice.logprobs] == [1, 2, 3, 4] and got[0].finished


def test_an_exception_behind_them_arrives_after_them():
    got, error = _read([_delta(1), _delta(2), RuntimeError("the engine failed")], on=True)
    assert [o.outputs[0].token_ids for o in got] == [(1, 2)]
    assert isinstance(error, RuntimeError) and "the engine failed" in str(error)


def test_an_error_report_is_not_joined():
    got, error = _read([_delta(1), _delta(2), _delta(error="out of blocks")], on=True)
    assert [o.outputs[0].token_ids for o in got] == [(1, 2)]
    assert isinstance(error, RequestFailedError) and "out of blocks" in str(error)


def test_off_every_delta_arrives_alone():
    got, error = _read([_delta(1), _delta(2, 3), _delta(4, finish="stop")], on=False)
    assert error is None and [o.outputs[0].token_ids for o in got] == [(1,), (2, 3), (4,)]


def test_streams_over_http_say_what_unstreamed_requests_say(compiled, tokenizer, monkeypatch):
    monkeypatch.setattr(async_engine, "COALESCE_STREAMS", True)
    body = {"prompt": "Hello there", "max_tokens": 12, "ignore_eos": True, "temperature": 0}

    async def streamed_text(client, url):
        text = ""
        async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def run(url):
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(streamed_text(client, url) for _ in range(16)))

    with serving(compiled, tokenizer) as server:
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert asyncio.run(run(server.url)) == [whole] * 16


@pytest.mark.parametrize("on", [False, True])
def test_a_request_without_queued_deltas_is_untouched(on):
    got, _ = _read([_delta(1, 2, finish="stop")], on=on)
    assert len(got) == 1 and got[0].outputs[0].token_ids == (1, 2)
