"""bench/grammar_backends.py: which grammar engine costs the host least per generated token?

Candidates: xgrammar, llguidance, outlines-core (each measured if it imports). Workload: a JSON schema
of the kind tool calls and ``json_schema`` responses use, 64 sequences (one decode batch) each emitting a
different valid instance tokenized by a real tokenizer (the demo model's, SmolLM2: 49152 tokens, or
``--tokenizer DIR``). One step = for every sequence: write its row of the ``[64, ceil(V/32)]`` int32
allowed-token bitmask, then advance its matcher by the sequence's next token. Reported: compile time of the
schema (cold), the step's time serially (one thread: what one core of the engine's host pays), and through
the engine's batch API where it has one (threads; this machine's core count bounds it), per step and per
token. Every backend must accept every token of every instance (else the row says so).

    python bench/probes/grammar_backends.py [--batch 64] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from structured_bench import CALL as SCHEMA  # the structured section times the same schema in the engine

CITIES = ["Paris", "San Francisco", "Tokyo", "Reykjavik", "Buenos Aires", "Cape Town", "Oslo", "Lima"]
WORDS = ["rain", "wind", "sun", "snow", "fog", "storm", "heat"]


def instances(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        value = {"name": rng.choice(SCHEMA["properties"]["name"]["enum"]),
                 "arguments": {"city": rng.choice(CITIES), "days": rng.randint(1, 14),
                               "units": rng.choice(["celsius", "fahrenheit"]),
                               "tags": rng.sample(WORDS, rng.randint(0, 4)), "exact": rng.random() < 0.5}}
        out.append(json.dumps(value, separators=(",", ":")))
    return out


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                   separators=(",", ":"), strict_mode=True)

    def matchers(self, compiled, n: int):
        return [self.xgr.GrammarMatcher(compiled) for _ in range(n)]

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def batch_step(self, matchers, bitmask: torch.Tensor, tokens: list[int]) -> bool:
        batch = self._batch(len(matchers))
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return all(self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))

    def _batch(self, n: int):
        if getattr(self, "_batch_matcher", None) is None:
            self._batch_matcher = self.xgr.BatchGrammarMatcher(max_threads="auto")
        return self._batch_matcher


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)  # the grammar is compiled lazily: build one now
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, grammar, n: int):
        return [self.ll.LLMatcher(self.tokenizer, grammar) for _ in range(n)]

    def fill(self, matcher, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def batch_step(self, matchers, bitmask: torch.Tensor, tokens: list[int]) -> bool:
        executor = getattr(self, "_executor", None) or self.ll.LLExecutor()
        self._executor = executor
        self.llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return all(m.consume_token(t) for m, t in zip(matchers, tokens))


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer, vocab_size: int):
        import outlines_core as oc
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        self.oc = oc
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        vocab: dict[bytes, list[int]] = {}
        eos = tokenizer.eos_token_id
        for token, token_id in tokenizer.get_vocab().items():
            if token_id == eos or token_id >= vocab_size:
                continue
            if token in tokenizer.all_special_tokens:
                continue
            vocab.setdefault(bytes(byte_of.get(c, 0) for c in token), []).append(token_id)
        self.vocab = oc.Vocabulary(eos, vocab)

    def compile(self, schema: dict):
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
        return self.oc.Index(regex, self.vocab)

    def matchers(self, index, n: int):
        return [self.oc.Guide(index) for _ in range(n)]

    def fill(self, guide, bitmask: torch.Tensor, row: int) -> None:
        guide.write_mask_into(bitmask[row].data_ptr(), bitmask[row].numel(), bitmask.element_size())

    def accept(self, guide, token: int) -> bool:
        guide.advance(token)
        return True

    batch_step = None


def measure(backend, token_lists: list[list[int]], vocab_size: int, repeats: int) -> dict:
    start = time.perf_counter()
    compiled = backend.compile(SCHEMA)
    compile_s = time.perf_counter() - start
    bitmask = torch.zeros(len(token_lists), (vocab_size + 31) // 32, dtype=torch.int32)
    steps = max(len(t) for t in token_lists)
    serial, batched, ok = [], [], True
    for _ in range(repeats):
        matchers = backend.matchers(compiled, len(token_lists))
        for step in range(steps):
            live = [(i, m, t[step]) for i, (m, t) in enumerate(zip(matchers, token_lists)) if step < len(t)]
            start = time.perf_counter()
            for row, matcher, _ in live:
                backend.fill(matcher, bitmask, row)
            filled = time.perf_counter()
            ok &= all(_allowed(bitmask, row, token) for row, _, token in live)  # (not timed)
            accepting = time.perf_counter()
            accepted = all([backend.accept(matcher, token) for _, matcher, token in live])
            serial.append((filled - start + time.perf_counter() - accepting, len(live)))
            ok &= accepted
        if backend.batch_step is None:
            continue
        matchers = backend.matchers(compiled, len(token_lists))
        for step in range(steps):
            live = [(m, t[step]) for m, t in zip(matchers, token_lists) if step < len(t)]
            if len(live) < len(matchers):  # the batch APIs take whole batches: time the full steps only
                break
            start = time.perf_counter()
            accepted = backend.batch_step([m for m, _ in live], bitmask, [t for _, t in live])
            batched.append((time.perf_counter() - start, len(live)))
            ok &= accepted
    return {"backend": backend.name, "compile_ms": compile_s * 1e3, "ok": ok,
            "serial_step_ms": _step_ms(serial, len(token_lists)), "serial_us_per_token": _per_token_us(serial),
            "batch_step_ms": _step_ms(batched, len(token_lists)) if batched else None,
            "batch_us_per_token": _per_token_us(batched) if batched else None}


def _step_ms(samples: list[tuple[float, int]], batch: int) -> float:
    """Mean time of the steps in which the whole batch was generating."""
    return statistics.mean(s for s, n in samples if n == batch) * 1e3


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool(bitmask[row, token // 32] >> (token % 32) & 1)


def _per_token_us(samples: list[tuple[float, int]]) -> float:
    return sum(s for s, _ in samples) / sum(n for _, n in samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the demo model's)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from autodeploy.demo import default_model_path

        args.tokenizer = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    token_lists = [tokenizer.encode(text, add_special_tokens=False) for text in instances(args.batch)]
    print(f"tokenizer {tokenizer.name_or_path} (vocabulary {vocab_size}); batch {args.batch}; "
          f"{statistics.mean(map(len, token_lists)):.1f} tokens per instance; torch threads {torch.get_num_threads()}")
    print(f"{'backend':<14} {'version':<10} {'compile ms':>10} {'step ms':>9} {'us/token':>9} "
          f"{'batch-API step ms':>18} {'us/token':>9}  valid")
    for cls in (Xgrammar, Llguidance, OutlinesCore):
        try:
            backend = cls(tokenizer, vocab_size)
        except ImportError as exc:
            print(f"{cls.name:<14} not installed ({exc})")
            continue
        row = measure(backend, token_lists, vocab_size, args.repeats)
        batch = (f"{row['batch_step_ms']:>18.2f} {row['batch_us_per_token']:>9.1f}" if row["batch_step_ms"]
                 else f"{'-':>18} {'-':>9}")
        print(f"{row['backend']:<14} {_version(cls.name):<10} {row['compile_ms']:>10.1f} {row['serial_step_ms']:>9.2f} "
              f"{row['serial_us_per_token']:>9.1f} {batch}  {'yes' if row['ok'] else 'NO'}")


def _version(dist: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(dist.replace("-", "_"))


if __name__ == "__main__":
    main()
