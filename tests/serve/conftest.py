"""Shared fixtures of the serving tests: one tiny checkpoint with a trained BPE tokenizer and a chat
template, compiled once per session (compiling is the slow part on the CPU)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# The tiny model's ops are far too small to gain from intra-op threads; on a shared 2-core CI
# machine they make every step ~10x slower instead.
torch.set_num_threads(1)

VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Serving language models means batching requests that arrive at different times.",
    "A paged key-value cache stores attention keys and values in fixed-size blocks.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
] * 20
COMPILE_OPTIONS = dict(device="cpu", dtype="float32", max_batch_size=64, max_num_tokens=256, max_seq_len=256,
                       num_kv_blocks=512, tokens_per_block=8)


def train_tokenizer(out_dir) -> None:
    """A byte-level BPE with <s>, </s> at the ids the tiny Llama config uses, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from autodeploy.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_checkpoint("llama", path, vocab_size=VOCAB_SIZE)
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def compiled(tiny_dir):
    import autodeploy

    return autodeploy.compile(tiny_dir, **COMPILE_OPTIONS)


@pytest.fixture(scope="session")
def tokenizer(tiny_dir):
    from autodeploy.serve.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir)


ENGINE_MODES = ["in_process", "engine_process"]
# The engine mode of every server test that names none: the engine in a process of its own (forked), as
# ``autodeploy serve`` runs it on CUDA. The other mode (the engine on a thread) runs where a test asks for
# both (``ENGINE_MODES``); AUTODEPLOY_TEST_ENGINE_MODE=in_process runs the whole suite that way.
DEFAULT_ENGINE_MODE = os.environ.get("AUTODEPLOY_TEST_ENGINE_MODE", "engine_process")


class LiveServer:
    """A uvicorn server on a free loopback port, in a thread; with ``state``, the server ``autodeploy
    serve`` runs (it drains on ``server.handle_exit``)."""

    def __init__(self, app, state=None, drain_timeout: float = 2.0):
        import threading

        import uvicorn

        from autodeploy.serve.shutdown import DrainingServer
        from autodeploy.serve.startup import bind_socket

        self.sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config) if state is None else DrainingServer(config, state, drain_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        import time

        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def make_state(compiled, tokenizer, *, served_model_name="tiny", api_key=None, limits=None, engine_process=None,
               warm_up=False, timeline=None, **options):
    """A ServerState serving ``compiled`` through a fresh engine (the caller shuts it down); ``options``
    are ServerState fields (``api_key_file``, ``metrics_without_key``, ``tools``, ``reasoning_parser``,
    ``metrics_prefix``...) or EngineConfig fields. With ``engine_process`` (default: ``DEFAULT_ENGINE_MODE``) the
    engine runs in a forked process of its own (as ``--engine_process on``), else on a thread of this one;
    ``warm_up`` runs the start-up requests first (``--warm_up``); ``timeline``: the engine process's timeline file
    (``--timeline``)."""
    from autodeploy.serve.async_engine import AsyncEngine
    from autodeploy.serve.engine import Engine, EngineConfig
    from autodeploy.serve.engine_client import fork_engine_process
    from autodeploy.serve.limits import RequestLimits
    from autodeploy.serve.serving_common import ServerState
    from autodeploy.serve.warmup import warm_up_engine

    state_fields = ("api_key_file", "metrics_without_key", "tools", "reasoning_parser", "metrics_prefix",
                    "model_aliases", "sampling_defaults")
    state_options = {k: options.pop(k) for k in state_fields if k in options}
    engine_options = options
    state = ServerState(served_model_name, api_key, limits=limits or RequestLimits(), **state_options)
    engine = Engine(compiled, tokenizer, EngineConfig(**engine_options))
    if warm_up:
        warm_up_engine(engine)
    if engine_process is None:
        engine_process = DEFAULT_ENGINE_MODE == "engine_process"
    if timeline and not engine_process:
        raise ValueError("the tests write a timeline of an engine in its own process only")
    front = fork_engine_process(engine, tokenizer, timeline=timeline) if engine_process else AsyncEngine(engine)
    state.attach(front, tokenizer, compiled.max_seq_len)
    return state


@contextlib.contextmanager
def serving(compiled, tokenizer, drain_timeout: float = 2.0, timeline=None, **options):
    """A live server over a fresh engine with these ServerState/engine options (``make_state``; with
    ``timeline`` both processes write that file, as ``autodeploy serve --timeline``); closed afterwards."""
    from autodeploy.serve.server import build_app
    from autodeploy.serve.timeline import open_timeline

    state = make_state(compiled, tokenizer, timeline=timeline, **options)
    app = build_app(state)
    api_timeline = open_timeline(timeline, "api") if timeline else None
    if api_timeline is not None:
        app = api_timeline.wrap_asgi(app, lambda: state.engine.num_streams)
        api_timeline.mark_ready()
    server = LiveServer(app, state, drain_timeout)
    server.state = state
    try:
        yield server
    finally:
        server.close()
        state.engine.shutdown()
        state.preprocess.close()
        if api_timeline is not None:
            api_timeline.close()


def pytest_generate_tests(metafunc):
    """A module with ``LIVE_MODES = ENGINE_MODES`` runs its ``live`` tests against both engines."""
    modes = getattr(metafunc.module, "LIVE_MODES", None)
    if modes and "live" in metafunc.fixturenames:
        metafunc.parametrize("live", modes, indirect=True, scope="module")


@pytest.fixture(scope="module")
def live(request, compiled, tokenizer):
    """A live server over the shared compiled model; one per test module (per engine mode where the
    module sets ``LIVE_MODES``)."""
    from autodeploy.serve.server import build_app

    mode = getattr(request, "param", DEFAULT_ENGINE_MODE)
    state = make_state(compiled, tokenizer, engine_process=mode == "engine_process")
    server = LiveServer(build_app(state))
    server.state = state
    yield server
    server.close()
    state.engine.shutdown()
    state.preprocess.close()


def settled_stats(engine, timeout: float = 10.0):
    """The engine's stats once no KV block is in use (or after ``timeout``): an engine in its own
    process reports its stats with each step's outputs, a little after the fact."""
    import time

    deadline = time.monotonic() + timeout
    while engine.stats().num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.stats()


def chat_reply(client, stream: bool, **args):
    """A chat completion's first choice through the openai client, whole or streamed, as
    ``((content, [(id, name, arguments)], reasoning_content), finish_reason)``; a streamed one is rebuilt
    as the client's users rebuild it, checking the order of the tool-call deltas (id, type, name first)."""
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return (choice.message.content, calls, getattr(choice.message, "reasoning_content", None)), choice.finish_reason
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = [call.id, call.function.name, call.function.arguments or ""]
            else:
                assert call.index in calls and call.function.name is None  # the name came first
                calls[call.index][2] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return (content or None, [tuple(c) for _, c in sorted(calls.items())], reasoning or None), finish


def wait_for_url(proc) -> str:
    """The URL an ``autodeploy serve`` subprocess says it listens on (read from its stderr)."""
    import re

    for line in proc.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"no 'listening on' line; exit code {proc.wait()}")
