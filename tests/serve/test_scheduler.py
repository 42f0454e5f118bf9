"""The scheduler's latency policy, without a model: decodes are scheduled every step, before any
prompt, and prompts are cut into chunks of at most ``max_num_prefill_tokens`` per step."""

from autodeploy.kvcache.block_manager import BlockManager
from autodeploy.sampling_params import SamplingParams
from autodeploy.serve.scheduler import Scheduler
from autodeploy.serve.sequence import Request, new_sequences


def _seq(request_id: str, prompt_len: int, max_tokens: int = 64):
    prompt = tuple(range(1, prompt_len + 1))
    request = Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0,
                      max_total_tokens=prompt_len + max_tokens)
    (seq,) = new_sequences(request, None)
    return seq


def _run(schedule) -> None:
    """What the engine does after a step: the chunks are computed, a sampling chunk appends a token."""
    for chunk in schedule.chunks:
        chunk.seq.num_computed = chunk.end
        if chunk.samples:
            chunk.seq.token_ids.append(7)


def _tokens_by_request(schedule) -> dict[str, int]:
    return {c.seq.request.request_id: c.num_tokens for c in schedule.chunks}


def test_decodes_run_every_step_while_a_long_prompt_prefills_in_chunks():
    scheduler = Scheduler(BlockManager(1024, 16), max_batch_size=64, max_num_tokens=2048, max_num_prefill_tokens=256)
    decoders = [_seq(f"d{i}", 20) for i in range(8)]
    for seq in decoders:
        scheduler.add(seq)
    _run(scheduler.schedule())  # the short prompts, in one step (8 x 20 tokens <= 256)
    long = _seq("long", 3000)
    scheduler.add(long)
    chunks = []
    while long.num_computed < 3000:
        schedule = scheduler.schedule()
        tokens = _tokens_by_request(schedule)
        assert all(tokens[f"d{i}"] == 1 for i in range(8)), tokens  # every decode, every step
        assert [c.seq.request.request_id for c in schedule.chunks[:8]] == [f"d{i}" for i in range(8)]
        assert schedule.num_tokens - 8 <= 256
        chunks.append(tokens["long"])
        _run(schedule)
    assert chunks == [256] * 11 + [3000 - 11 * 256]


def test_new_prompts_share_the_prefill_budget_and_queue_behind_it():
    scheduler = Scheduler(BlockManager(1024, 16), max_batch_size=64, max_num_tokens=4096, max_num_prefill_tokens=100)
    for i in range(4):
        scheduler.add(_seq(f"p{i}", 40))
    first = scheduler.schedule()
    assert _tokens_by_request(first) == {"p0": 40, "p1": 40, "p2": 20}
    _run(first)
    second = scheduler.schedule()
    # p0 and p1 decode; p2 finishes its prompt; p3 starts within what is left
    assert _tokens_by_request(second) == {"p0": 1, "p1": 1, "p2": 20, "p3": 40}


def test_a_busy_batch_prefills_within_the_smaller_budget_and_a_filling_one_within_the_larger():
    """max_batch_size 8: with 4 or more decodes in the step, prompts get ``busy_prefill_tokens``."""
    scheduler = Scheduler(BlockManager(1024, 16), max_batch_size=8, max_num_tokens=4096, max_num_prefill_tokens=100,
                          busy_prefill_tokens=30)
    for i in range(3):
        scheduler.add(_seq(f"p{i}", 40))
    first = scheduler.schedule()
    assert _tokens_by_request(first) == {"p0": 40, "p1": 40, "p2": 20}  # nothing decodes: the full budget
    _run(first)
    for i in range(3, 8):
        scheduler.add(_seq(f"p{i}", 40))
    second = scheduler.schedule()  # 2 decodes of 8: still filling
    assert _tokens_by_request(second) == {"p0": 1, "p1": 1, "p2": 20, "p3": 40, "p4": 40}
    _run(second)
    third = scheduler.schedule()  # 5 decodes: busy, 30 prompt tokens
    assert _tokens_by_request(third) == {"p0": 1, "p1": 1, "p2": 1, "p3": 1, "p4": 1, "p5": 30}
    assert Scheduler(BlockManager(8, 16), 4, 256, 100, 1000).busy_prefill_tokens == 100  # never above the budget
    assert Scheduler(BlockManager(8, 16), 4, 256, 100).busy_prefill_tokens == 100


def test_without_a_prefill_budget_prompts_may_take_the_whole_step():
    scheduler = Scheduler(BlockManager(1024, 16), max_batch_size=64, max_num_tokens=512)
    scheduler.add(_seq("a", 600))
    assert scheduler.max_num_prefill_tokens == 512
    assert _tokens_by_request(scheduler.schedule()) == {"a": 512}


def test_out_of_blocks_a_prefill_never_preempts_a_decode_already_in_the_step():
    """Blocks for 5 sequences of 16 tokens: the decodes take theirs first, the prompt chunk that
    does not fit waits, and nothing in the step is preempted."""
    scheduler = Scheduler(BlockManager(5, 16), max_batch_size=8, max_num_tokens=256)
    decoders = [_seq(f"d{i}", 15) for i in range(4)]
    for seq in decoders:
        scheduler.add(seq)
    _run(scheduler.schedule())
    late = _seq("late", 40)  # needs 3 blocks, 1 is free
    scheduler.add(late)
    schedule = scheduler.schedule()  # each decode needs its second block: 4 > 1 free
    in_step = {c.seq for c in schedule.chunks}
    assert not in_step & set(schedule.preempted)
    assert all(seq.block_ids for seq in in_step)


def test_the_server_defaults_to_512_prompt_tokens_a_step_128_next_to_a_busy_batch_and_0_turns_them_off():
    from autodeploy.serve.startup import ServeSettings, engine_config

    assert engine_config(ServeSettings()).max_num_prefill_tokens == 512
    assert engine_config(ServeSettings(max_num_prefill_tokens=0)).max_num_prefill_tokens is None
    assert engine_config(ServeSettings()).busy_prefill_tokens == 128
    assert engine_config(ServeSettings(busy_prefill_tokens=0)).busy_prefill_tokens is None
    assert engine_config(ServeSettings(busy_prefill_tokens=64)).busy_prefill_tokens == 64
    assert Scheduler(BlockManager(8, 16), 4, 256, None).max_num_prefill_tokens == 256
    assert Scheduler(BlockManager(8, 16), 4, 256, 1024).max_num_prefill_tokens == 256  # never above the step
