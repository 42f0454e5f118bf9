"""Shared fixtures of the serving tests: one tiny checkpoint with a trained BPE tokenizer and a chat
template, compiled once per session (compiling is the slow part on the CPU)."""

from __future__ import annotations

import contextlib

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


def make_state(compiled, tokenizer, *, served_model_name="tiny", api_key=None, limits=None, **options):
    """A ServerState serving ``compiled`` through a fresh engine (the caller shuts it down); ``options``
    are ServerState fields (``api_key_file``, ``metrics_without_key``, ``metrics_prefix``...) or EngineConfig
    fields."""
    from autodeploy.serve.async_engine import AsyncEngine
    from autodeploy.serve.engine import Engine, EngineConfig
    from autodeploy.serve.limits import RequestLimits
    from autodeploy.serve.serving_common import ServerState

    state_fields = ("api_key_file", "metrics_without_key", "metrics_prefix", "model_aliases", "sampling_defaults")
    state_options = {k: options.pop(k) for k in state_fields if k in options}
    engine_options = options
    state = ServerState(served_model_name, api_key, limits=limits or RequestLimits(), **state_options)
    engine = AsyncEngine(Engine(compiled, tokenizer, EngineConfig(**engine_options)))
    state.attach(engine, tokenizer, compiled.max_seq_len)
    return state


@contextlib.contextmanager
def serving(compiled, tokenizer, drain_timeout: float = 2.0, **options):
    """A live server over a fresh engine with these ServerState/engine options; closed afterwards."""
    from autodeploy.serve.server import build_app

    state = make_state(compiled, tokenizer, **options)
    server = LiveServer(build_app(state), state, drain_timeout)
    server.state = state
    try:
        yield server
    finally:
        server.close()
        state.engine.shutdown()
        state.preprocess.close()


@pytest.fixture(scope="module")
def live(compiled, tokenizer):
    """A live server over the shared compiled model; one per test module."""
    from autodeploy.serve.server import build_app

    state = make_state(compiled, tokenizer)
    server = LiveServer(build_app(state))
    server.state = state
    yield server
    server.close()
    state.engine.shutdown()
    state.preprocess.close()


def wait_for_url(proc) -> str:
    """The URL an ``autodeploy serve`` subprocess says it listens on (read from its stderr)."""
    import re

    for line in proc.stderr:
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return match.group(1)
    raise AssertionError(f"no 'listening on' line; exit code {proc.wait()}")
