"""vLLM's Grafana dashboard against ``/metrics`` of a live tiny server: every series each panel queries
is there, with the dashboard's ``model_name`` label; requests are counted as requests."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import serving
from prometheus_client.parser import text_string_to_metric_families

from autodeploy import SamplingParams

# Every query of vLLM's shipped dashboard, examples/observability/prometheus_grafana/grafana.json
# (vllm-project/vllm at 4b5c627c), copied as data; its previous version
# (examples/online_serving/prometheus_grafana/grafana.json) queried two series by older names, added at the end.
DASHBOARD_QUERIES = {
    "E2E Request Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}'
        '[$__rate_interval])))',
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Token Throughput": [
        'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    ],
    "Inter Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:inter_token_latency_seconds_bucket{model_name="$model_name"}'
        '[$__rate_interval])))',
        'rate(vllm:inter_token_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:inter_token_latency_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Scheduler State": [
        'vllm:num_requests_running{model_name="$model_name"}',
        'vllm:num_requests_waiting{model_name="$model_name"}',
    ],
    "Time To First Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}'
        '[$__rate_interval])))',
        'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])\n/\n'
        'rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])',
    ],
    "Cache Utilization": ['vllm:kv_cache_usage_perc{model_name="$model_name"}'],
    "Request Prompt Length": [
        'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'],
    "Finish Reason": [
        'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))'],
    "Queue Time": ['rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    ],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])'],
    # the previous version of the dashboard
    "Time Per Output Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket'
        '{model_name="$model_name"}[$__rate_interval])))'],
    "Cache Utilization (previous)": ['vllm:gpu_cache_usage_perc{model_name="$model_name"}'],
}
SELECTOR = re.compile(r'(vllm:[A-Za-z_:]+)\{([^}]*)\}')
MATCHER = re.compile(r'(\w+)="([^"]*)"')
GROUPING = re.compile(r'by\s*\((\w+)\)')


def series(text: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it has, from Prometheus text."""
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(sample.labels)
    return found


def selected(query: str, model_name: str, exposed: dict) -> list[tuple[str, int]]:
    """Each series selector of ``query`` (its $model_name filled in) and how many exposed samples it selects
    that also carry the labels the query groups by (``sum by(finished_reason)``)."""
    rendered = query.replace("$model_name", model_name).replace("$__rate_interval", "1m")
    grouped_by = set(GROUPING.findall(rendered))
    out = []
    for name, matchers in SELECTOR.findall(rendered):
        wanted = dict(MATCHER.findall(matchers))
        out.append((name, sum(all(labels.get(k) == v for k, v in wanted.items()) and grouped_by <= set(labels)
                              for labels in exposed.get(name, []))))
    return out


def test_every_dashboard_query_finds_its_series(compiled, tokenizer):
    with serving(compiled, tokenizer) as server:
        for stream in (False, True):
            body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 4, "n": 2, "stream": stream,
                    "temperature": 0.8}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
        text = httpx.get(server.url + "/metrics", timeout=10).text
    exposed = series(text)
    for panel, queries in DASHBOARD_QUERIES.items():
        for query in queries:
            for name, count in selected(query, "tiny", exposed):
                assert count > 0, f"panel '{panel}': no series {name}{{model_name=\"tiny\"}} in /metrics"
    missing_label = 'sum by(no_such_label) (vllm:num_requests_running{model_name="$model_name"})'
    assert selected(missing_label, "tiny", exposed) == [("vllm:num_requests_running", 0)]  # (the check can fail)
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples if not s.labels.get("le")}
    assert samples["vllm:request_prompt_tokens_count"].value == 2  # two requests, each of two choices
    assert samples["vllm:request_max_num_generation_tokens_sum"].value == 8  # 4 per request, its longest choice
    assert samples["vllm:request_generation_tokens_sum"].value == 16
    assert samples["vllm:request_prefill_time_seconds_count"].value == 2
    assert samples["autodeploy_request_decode_time_seconds_count"].value == 2  # (the same series, both names)


@pytest.mark.parametrize("prefix, present, absent", [("vllm", "vllm:", "autodeploy_"),
                                                     ("autodeploy", "autodeploy_", "vllm:")])
def test_one_set_of_names(compiled, tokenizer, prefix, present, absent):
    with serving(compiled, tokenizer, metrics_prefix=prefix) as server:
        names = series(httpx.get(server.url + "/metrics", timeout=10).text)
    assert any(n.startswith(present) for n in names) and not any(n.startswith(absent) for n in names)


def test_running_requests_are_counted_as_requests(compiled, tokenizer):
    from autodeploy.serve.engine import Engine, EngineConfig

    engine = Engine(compiled, tokenizer, EngineConfig())
    engine.add_request("a", [1, 5, 7], SamplingParams(n=3, max_tokens=4, temperature=1.0, ignore_eos=True))
    engine.add_request("b", [1, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert (stats.num_running_requests, stats.num_running) == (2, 4)
    assert (stats.num_waiting_requests, stats.num_waiting) == (0, 0)
