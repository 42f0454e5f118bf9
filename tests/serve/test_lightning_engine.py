"""The engine on a model with lightning attention (a tiny MiniMax, blocks of 16): more requests than state
slots, prompts of up to three lightning blocks prefilled in chunks beside other sequences' decodes, and
preemption under the overlapped (async) loop all generate what each request generates alone; every KV
block and state slot comes back. (The zoo's engine check covers preemption and abort on the plain loop.)"""

import pytest
from test_engine import run_batched, run_one_at_a_time, tokens
from test_state_engine import SLOTS, _all_returned, _prompts

from autodeploy import SamplingParams
from autodeploy.serve.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    import autodeploy
    from autodeploy.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint("minimax", tmp_path_factory.mktemp("minimax"))
    return autodeploy.compile(path, device="cpu", dtype="float32", max_batch_size=SLOTS, max_num_tokens=48,
                              max_seq_len=96, num_kv_blocks=64, tokens_per_block=8)


def test_batched_chunked_and_preempted_steps_equal_one_request_at_a_time(minimax):
    prompts = _prompts(minimax.vocab_size, [3, 40, 7, 1, 30, 12])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # alone, the 40-token prompt is one step of 40 tokens (past the 16 of the block HF's exported graph holds)
    single = tokens(run_one_at_a_time(Engine(minimax, None, EngineConfig()), prompts, params))
    engine = Engine(minimax, None, EngineConfig(max_batch_size=6, max_num_tokens=16))
    assert minimax.num_state_slots == SLOTS and not engine.blocks.enable_prefix_caching
    assert tokens(run_batched(engine, prompts, params)) == single and _all_returned(engine)
    tight = Engine(minimax, None, EngineConfig(num_blocks=8, overlap=True))
    assert tokens(run_batched(tight, prompts, params)) == single
    assert tight.stats().num_preemptions > 0 and _all_returned(tight)
