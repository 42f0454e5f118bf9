"""Structured outputs in the engine and the server: every output follows its grammar in every sampling mode,
with async scheduling, preemption, ``n`` and aborts; bad or hostile grammars are 400s with the reason."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import jsonschema_rs
import pytest
import torch

from autodeploy import SamplingParams, StructuredOutput
from autodeploy.serve.engine import Engine, EngineConfig
from autodeploy.serve.limits import RequestLimits
from autodeploy.serve.structured import GrammarCompiler, GrammarError, apply_token_bitmask

from conftest import serving
from test_engine import _prompts, run_batched, tokens

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"
CHOICES = ["alpha", "beta gamma", "déjà vu"]
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | "zz"'


def _specs() -> list[StructuredOutput]:
    return [StructuredOutput("json", json.dumps(SCHEMA)), StructuredOutput("regex", REGEX),
            StructuredOutput("choice", json.dumps(CHOICES)), StructuredOutput("grammar", EBNF)]


def _follows(spec: StructuredOutput, text: str) -> bool:
    if spec.kind == "json":
        return jsonschema_rs.is_valid(json.loads(spec.spec), json.loads(text))
    if spec.kind == "json_object":
        return isinstance(json.loads(text), dict)
    if spec.kind == "regex":
        return re.fullmatch(spec.spec, text) is not None
    if spec.kind == "choice":
        return text in json.loads(spec.spec)
    return re.fullmatch(r"\((?:[a-c]|zz)(?:,(?:[a-c]|zz)){0,3}\)", text) is not None


def _mixed_requests(vocab: int):
    """Each grammar with greedy, seeded sampling (n=2, top-k/top-p) and penalties, next to free requests."""
    specs = _specs()
    params = []
    for i, spec in enumerate(specs):
        params += [SamplingParams(temperature=0, max_tokens=64, structured=spec),
                   SamplingParams(n=2, temperature=1.0, top_p=0.95, top_k=100, seed=i, max_tokens=64, structured=spec),
                   SamplingParams(temperature=0.8, seed=10 + i, presence_penalty=0.5, max_tokens=64, structured=spec)]
    params += [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 2
    return _prompts(vocab, [5, 17, 3, 11, 9, 30, 2, 8, 14, 6, 21, 4, 13, 7], shared_prefix=6, seed=3), params


def _check_outputs(outputs, params) -> None:
    for out, p in zip(outputs, params):
        for choice in out.outputs:
            if p.structured is None:
                assert choice.finish_reason == "length"
                continue
            assert choice.finish_reason == "stop", (p.structured.kind, choice.text)  # the grammar ended it
            assert _follows(p.structured, choice.text), (p.structured.kind, choice.text)


def test_outputs_follow_their_grammar_with_and_without_overlap_and_preemption(compiled, tokenizer):
    prompts, params = _mixed_requests(compiled.vocab_size)
    free = run_batched(Engine(compiled, tokenizer), prompts[-2:], params[-2:])
    results = {}
    for name, config in {"sync": EngineConfig(), "overlap": EngineConfig(overlap=True),
                         "preempted": EngineConfig(num_blocks=16, overlap=True)}.items():
        engine = Engine(compiled, tokenizer, config)
        results[name] = run_batched(engine, prompts, params)
        assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
        if name == "preempted":
            assert engine.stats().num_preemptions > 0
    _check_outputs(results["sync"], params)
    assert tokens(results["overlap"]) == tokens(results["sync"]) == tokens(results["preempted"])
    assert tokens(results["sync"][-2:]) == tokens(free)  # rows without a grammar are untouched


def test_greedy_takes_the_most_likely_allowed_token(compiled, tokenizer):
    """The reported log-probabilities are the constrained distribution's: every top entry is allowed, and
    greedy picks the first; the same request without the grammar picks tokens the grammar forbids."""
    spec = StructuredOutput("choice", json.dumps(CHOICES))
    engine = Engine(compiled, tokenizer)
    prompt = _prompts(compiled.vocab_size, [9], seed=4)[0]
    (out,) = run_batched(engine, [prompt], [SamplingParams(temperature=0, max_tokens=16, logprobs=5, structured=spec)])
    choice = out.outputs[0]
    assert choice.text in CHOICES
    for i, (entry, token) in enumerate(zip(choice.logprobs, choice.token_ids)):
        assert entry.top[0][0] == token
        before = tokenizer.decode(choice.token_ids[:i])
        for t, logprob in entry.top:
            allowed = (t == 2 and before in CHOICES) or any(c.startswith(before + tokenizer.decode([t])) for c in CHOICES)
            assert allowed or logprob == float("-inf"), (before, tokenizer.decode([t]), logprob)
    (free,) = run_batched(engine, [prompt], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    assert free.outputs[0].text not in CHOICES


def test_json_object_and_abort(compiled, tokenizer):
    engine = Engine(compiled, tokenizer, EngineConfig(overlap=True))
    spec = StructuredOutput("json_object")
    for i in range(3):
        engine.add_request(str(i), [5 + i, 9, 12], SamplingParams(temperature=0.9, seed=i, max_tokens=48, structured=spec))
    engine.step(), engine.step(), engine.step()
    assert engine.abort_request("1").finished
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert set(finals) <= {"0", "2"} and engine.blocks.num_used == 0


def test_a_bad_grammar_fails_its_request_alone(compiled, tokenizer):
    engine = Engine(compiled, tokenizer)
    with pytest.raises(GrammarError, match='Unsupported type "nonsense"'):
        engine.compile_grammar(StructuredOutput("json", '{"type": "nonsense"}'))
    engine.add_request("bad", [5, 6, 7], SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "a(b")))
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    reports = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    assert "parenthesis is not closed" in reports["bad"][-1].error
    assert sum(len(c.token_ids) for o in reports["good"] for c in o.outputs) == 8
    assert engine.blocks.num_used == 0


def test_bitmask_matches_a_dense_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=gen)
    allowed = torch.rand(3, 70, generator=gen) < 0.3
    padded = torch.nn.functional.pad(allowed, (0, 96 - 70)).view(3, 3, 32).to(torch.int64)
    words = (padded << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    rows = [0, 2, 3]
    expected = logits.clone()
    expected[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(apply_token_bitmask(logits, rows, bitmask), expected)  # some rows
    assert torch.equal(apply_token_bitmask(logits[:3], [0, 1, 2], bitmask), logits[:3].masked_fill(~allowed, float("-inf")))


@pytest.mark.slow
def test_isolated_compile_is_killed_past_its_deadline(tokenizer):
    """A hostile schema (deep nesting) stops at the deadline, its failure is remembered, and the next grammar
    compiles in a fresh worker."""
    compiler = GrammarCompiler(tokenizer, len(tokenizer), (2,), timeout=1.0)
    nested: dict = {"type": "integer"}
    for _ in range(400):
        nested = {"type": "object", "properties": {"x": nested}, "required": ["x"]}
    hostile = StructuredOutput("json", json.dumps(nested))
    try:
        compiler.compile(StructuredOutput("regex", "[ab]+"))  # the worker is up: the deadline is the compile's alone
        with pytest.raises(GrammarError, match="did not compile within 1 s"):
            compiler.compile(hostile)
        with pytest.raises(GrammarError, match="did not compile within 1 s"):
            compiler.compile(hostile)  # remembered: no second compile
        assert compiler.compile(StructuredOutput("json", json.dumps(SCHEMA))).memory_size_bytes > 0
    finally:
        compiler.close()


# ---- over HTTP -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(compiled, tokenizer):
    with serving(compiled, tokenizer, limits=RequestLimits(max_grammar_chars=2000)) as live:
        yield live


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=120)


def test_response_format_json_schema_streamed_and_whole(server):
    body = {"messages": [{"role": "user", "content": "Hello"}], "temperature": 1.0, "seed": 3, "n": 2,
            "max_tokens": 64, "response_format": {"type": "json_schema", "json_schema": {
                "name": "thing", "schema": SCHEMA, "strict": True}}}
    whole = _post(server, "/v1/chat/completions", body).json()
    texts = [c["message"]["content"] for c in whole["choices"]]
    streamed = ["", ""]
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == texts
    assert all(jsonschema_rs.is_valid(SCHEMA, json.loads(t)) for t in texts)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ({"structured_outputs": {"grammar": EBNF}}, lambda t: _follows(StructuredOutput("grammar", EBNF), t)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_completions_take_vllm_fields(server, extra, check):
    body = {"prompt": "Numbers:", "max_tokens": 48, "temperature": 0.7, "seed": 1, "n": 2, **extra}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    finished = [c["text"] for c in choices if c["finish_reason"] == "stop"]
    assert finished and all(check(text) for text in finished), choices  # (an unbounded JSON object may run long)


def test_a_length_bounded_json_string_takes_no_raw_control_characters(tokenizer):
    """xgrammar 0.2.9 lets them into strings with maxLength; the compiled grammar must not (json.loads refuses)."""
    import xgrammar

    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 4}}, "required": ["a"]}
    matcher = xgrammar.GrammarMatcher(compiler.compile(StructuredOutput("json", json.dumps(schema))))
    assert matcher.accept_string('{"a": "x')
    assert not matcher.accept_string("\t") and matcher.accept_string('y"}')


@pytest.mark.parametrize("extra, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     'Unsupported type \\"nonsense\\"'),
    ({"guided_regex": "a(b"}, "parenthesis is not closed"),
    ({"guided_grammar": "root ::= foo"}, 'Rule \\"foo\\" is not defined'),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output at a time"),
    ({"response_format": {"type": "json_schema"}}, "needs json_schema.schema"),
    ({"guided_json": {"enum": ["x" * 50] * 50}}, "--max_grammar_chars"),
    ({"structured_outputs": {"structural_tag": {}}}, "structural_tag is not supported"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "uses xgrammar"),
])
def test_grammar_errors_are_400_with_the_reason(server, extra, message):
    response = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **extra})
    assert response.status_code == 400, response.text
    assert message in response.text


def test_the_overhead_bench_runs_at_tiny_size(compiled, tokenizer, monkeypatch):
    """bench/structured_bench.py (the GPU's batch-64 overhead table) at tiny size: 64 sequences decode under the
    grammar in every timed step, and the rows say what it costs."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import structured_bench

    timings = structured_bench.overhead(compiled, tokenizer, batch=64, context=4, steps=2, warmup=1)
    free, constrained = structured_bench.rows("tiny batch 64", 64, timings)
    assert (free.impl, constrained.impl) == ("autodeploy engine free", "autodeploy engine json_schema")
    extra_ms = timings["json_schema"]["ms"] - timings["free"]["ms"]
    assert constrained.metrics["overhead_ms_per_step"] == pytest.approx(extra_ms)
    assert "us/token over free" in constrained.note and free.tokens_per_s > 0


def test_offline_llm_takes_a_grammar(compiled, tokenizer):
    """``LLM.generate`` compiles in its own process (no deadline) and follows the grammar as the server does."""
    import autodeploy

    llm = autodeploy.LLM(compiled, tokenizer)
    params = SamplingParams(temperature=0.8, seed=2, max_tokens=64, structured=StructuredOutput("regex", REGEX))
    (out,) = llm.generate([[5, 9, 12]], params)
    assert re.fullmatch(REGEX, out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
