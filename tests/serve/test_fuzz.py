"""Schemathesis against the live server, bounded in time: every route of /openapi.json, with valid
and invalid inputs generated from it (hypothesis); no answer may be a server error or break the
documented contract (status codes, content types, response schemas), and the engine must still
serve afterwards, with no KV block left behind."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from conftest import serving

EXAMPLES = 40  # per route and mode: about a minute for all of them on two CPU cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
ROUTES = ["GET /health", "GET /version", "GET /metrics", "GET /v1/models", "GET /v1/models/{model_id}",
          "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
          "GET /tokenizer_info"]


@pytest.fixture(scope="module")
def fuzzed(compiled, tokenizer):
    with serving(compiled, tokenizer) as server:
        yield server


@pytest.fixture(scope="module")
def operations(fuzzed):
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    found = {op.label: op for op in (result.ok() for result in schema.get_all_operations())}
    assert sorted(found) == sorted(ROUTES)  # every route is fuzzed
    return found


CASES = [(route, GenerationMode.POSITIVE) for route in ROUTES] + [
    (route, GenerationMode.NEGATIVE) for route in ROUTES if route.startswith("POST")]  # (GETs take no input)


@pytest.mark.slow
@pytest.mark.parametrize("route, mode", CASES, ids=[f"{r}-{m.value}" for r, m in CASES])
def test_no_route_answers_a_server_error(fuzzed, operations, route, mode):
    @given(case=operations[route].as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              phases=[Phase.explicit, Phase.generate], derandomize=True)
    def call(case):
        case.call_and_validate(base_url=fuzzed.url, timeout=60, checks=CHECKS)

    call()


def test_the_engine_still_serves_after_the_fuzz(fuzzed):
    assert httpx.get(fuzzed.url + "/health").json() == {"status": "ok"}
    body = httpx.post(fuzzed.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
                      timeout=60).json()
    assert body["usage"]["completion_tokens"] == 3
    assert fuzzed.state.engine.stats().num_used_blocks == 0
