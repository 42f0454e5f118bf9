import pytest

from autodeploy.kvcache.block_manager import BlockManager, OutOfBlocks

BS = 4


def test_allocate_and_free_return_blocks():
    bm = BlockManager(8, BS)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_used == 3 and bm.num_free == 5
    bm.free(a)
    assert bm.num_used == 0 and bm.num_free == 8
    with pytest.raises(OutOfBlocks):
        bm.allocate(9)


def test_double_free_is_an_error():
    bm = BlockManager(4, BS)
    (b,) = bm.allocate(1)
    bm.free([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        bm.free([b])


def _computed_sequence(bm, tokens):
    blocks = bm.allocate(-(-len(tokens) // BS))
    keys = bm.cache_full_blocks(blocks, tokens, len(tokens), [])
    return blocks, keys


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(16, BS)
    tokens = list(range(10))  # two full blocks and a partial one
    blocks, keys = _computed_sequence(bm, tokens)
    assert len(keys) == 2
    match = bm.match_prefix(tokens[:9] + [99], max_blocks=10)
    assert match.block_ids == tuple(blocks[:2]) and match.num_tokens == 8 and match.keys == tuple(keys)
    assert bm.prefix_queries == 0  # only lookups the caller reports are counted
    bm.count_lookup(10, match)
    bm.free(blocks)  # the first owner leaves; the shared blocks stay referenced by the match
    assert bm.num_used == 2
    bm.free(match.block_ids)
    assert bm.num_used == 0
    assert bm.prefix_queries == 10 and bm.prefix_hits == 8 and bm.hit_rate == pytest.approx(0.8)


def test_prefix_key_covers_the_whole_prefix_not_just_the_block():
    bm = BlockManager(16, BS)
    _computed_sequence(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    # same second block, different first block: no hit at all
    assert bm.match_prefix([9, 9, 9, 9, 5, 6, 7, 8], max_blocks=2).num_tokens == 0


def test_max_blocks_limits_the_match():
    bm = BlockManager(16, BS)
    blocks, _ = _computed_sequence(bm, list(range(12)))
    assert bm.match_prefix(list(range(12)), max_blocks=2).block_ids == tuple(blocks[:2])


def test_unreferenced_cached_blocks_are_evicted_oldest_first():
    bm = BlockManager(4, BS)
    first, _ = _computed_sequence(bm, [1] * 4)
    second, _ = _computed_sequence(bm, [2] * 4)
    bm.free(first)
    bm.free(second)
    assert bm.num_free == 4 and bm.num_used == 0
    bm.allocate(3)  # two never-cached blocks, then the oldest cached one (first)
    assert bm.match_prefix([1] * 4, max_blocks=1).num_tokens == 0
    assert bm.match_prefix([2] * 4, max_blocks=1).num_tokens == 4


def test_hit_on_an_evictable_block_takes_it_out_of_the_lru():
    bm = BlockManager(2, BS)
    blocks, _ = _computed_sequence(bm, [7] * 4)
    bm.free(blocks)
    match = bm.match_prefix([7] * 4 + [1], max_blocks=1)
    assert match.block_ids == tuple(blocks)
    bm.allocate(1)
    with pytest.raises(OutOfBlocks):
        bm.allocate(1)  # the matched block is referenced, not evictable


def test_duplicate_prefix_keeps_the_first_cached_copy():
    bm = BlockManager(8, BS)
    a, _ = _computed_sequence(bm, [3] * 4)
    b, _ = _computed_sequence(bm, [3] * 4)  # computed concurrently, before it could hit
    bm.free(b)
    assert bm.num_free == 7  # b was not keyed: it went straight back to the free list
    assert bm.match_prefix([3] * 4, max_blocks=1).block_ids == tuple(a)


def test_prefix_caching_off_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    blocks, keys = _computed_sequence(bm, list(range(8)))
    assert keys == []
    match = bm.match_prefix(list(range(8)), max_blocks=2)
    assert match.num_tokens == 0
    bm.count_lookup(8, match)
    assert bm.prefix_queries == 0
    bm.free(blocks)
    assert bm.num_free == 8


def test_state_slots_are_handed_out_once_and_taken_back():
    manager = BlockManager(4, 2, enable_prefix_caching=False, num_state_slots=2)
    first, second = manager.allocate_state_slot(), manager.allocate_state_slot()
    assert {first, second} == {0, 1} and manager.num_free_state_slots == 0
    with pytest.raises(OutOfBlocks, match="all 2 state slots"):
        manager.allocate_state_slot()
    manager.free_state_slot(first)
    with pytest.raises(RuntimeError, match="freed but not taken"):
        manager.free_state_slot(first)
    assert manager.allocate_state_slot() == first


def test_prefix_caching_is_refused_with_state_slots():
    with pytest.raises(ValueError, match="prefix caching cannot serve a model with state slots"):
        BlockManager(4, 2, enable_prefix_caching=True, num_state_slots=1)
