"""The prefix cache's index, without a device: which slot a request takes and what it reuses."""
from mesh_transformer.serve.prefix import PAGE, Placement, PrefixIndex, block_names

SHARED = list(range(100, 100 + 3 * PAGE))  # three full blocks


def test_block_names_name_the_whole_prefix_not_just_the_block():
    a, b = block_names(SHARED), block_names([7] + SHARED[1:])
    assert len(a) == 3 and len(block_names(SHARED[:-1])) == 2
    assert a[0] != b[0] and a[1] != b[1]  # same tokens in block 1, different prefix before it
    assert block_names(SHARED + [1, 2]) == a


def test_a_request_reuses_its_longest_prefix_held_by_a_free_slot_itself():
    index = PrefixIndex(n_slots=4, n_local=4)
    first = index.place(SHARED + [1], [0, 1, 2, 3], set())
    assert first == Placement(0, 0, 0)
    index.hold(0, SHARED + [1])
    # Slot 0 is busy: another request with the same prefix copies it into a free slot of the group.
    assert index.place(SHARED + [2, 3], [1, 2, 3], set()) == Placement(1, 0, 3 * PAGE)
    index.hold(1, SHARED + [2, 3])
    # Once free, slot 0 itself is taken by a request sharing two blocks with it (no copy), keeping those two.
    assert index.place(SHARED[:2 * PAGE] + [9] * PAGE, [0, 2, 3], set()) == Placement(0, 0, 2 * PAGE)
    assert index.held[0] == block_names(SHARED)[:2]
    assert index.hit_tokens == 5 * PAGE and index.queried_tokens == (len(SHARED) + 1) + (len(SHARED) + 2) + 3 * PAGE


def test_the_last_prompt_token_is_always_computed():
    index = PrefixIndex(n_slots=2, n_local=2)
    index.place(SHARED, [0, 1], set())
    index.hold(0, SHARED)
    assert index.place(SHARED, [1], set()) == Placement(1, 0, 2 * PAGE)  # not 3: the last block holds the last token


def test_copies_stay_within_a_dp_group_and_sources_are_not_taken_in_the_same_round():
    index = PrefixIndex(n_slots=4, n_local=2)  # group 0: slots 0, 1; group 1: slots 2, 3
    index.place(SHARED + [1], [0, 1, 2, 3], set())
    index.hold(0, SHARED + [1])
    assert index.place(SHARED + [2], [2, 3], set()) == Placement(2, 2, 0)  # group 1 holds nothing of it
    # Slot 0 is free but copied from this round (pinned): the request copies it into slot 1, never takes slot 0.
    assert index.place(SHARED + [3], [0, 1, 3], {0}) == Placement(1, 0, 3 * PAGE)
    assert index.place(SHARED + [4], [0], {0}) is None


def test_a_slot_taken_in_a_round_is_a_source_only_for_what_its_new_request_keeps():
    index = PrefixIndex(n_slots=3, n_local=3)
    index.place(SHARED + [1], [0, 1, 2], set())
    index.hold(0, SHARED + [1])
    assert index.place(SHARED[:PAGE] + [5] * 2 * PAGE, [0, 1, 2], set()) == Placement(0, 0, PAGE)
    # Slot 0's second and third blocks are being overwritten this round: only its first is shared.
    assert index.place(SHARED + [2], [1, 2], set()) == Placement(1, 0, PAGE)


def test_without_reuse_the_engines_first_free_slot_is_taken_and_its_blocks_evicted():
    index = PrefixIndex(n_slots=3, n_local=3)
    for slot, first in enumerate([1, 2, 3]):
        assert index.place([first] * 2 * PAGE, list(range(slot, 3)), set()).slot == slot
        index.hold(slot, [first] * 2 * PAGE)
    assert index.place([9] * 2 * PAGE, [0, 1, 2], set()) == Placement(0, 0, 0)  # the lowest row, not the oldest
    assert not index.holders.get(block_names([1] * 2 * PAGE)[0])  # slot 0's blocks are gone
    assert index.place([3] * 2 * PAGE, [1, 2], set()) == Placement(1, 2, PAGE)  # slot 2's copied into row 1


def test_hold_adds_the_tokens_written_after_the_prompt():
    index = PrefixIndex(n_slots=2, n_local=2)
    index.place(SHARED[:PAGE + 3], [0, 1], set())
    index.hold(0, SHARED[:PAGE + 3])
    assert len(index.held[0]) == 1
    index.hold(0, SHARED)  # the request ended with the rest of SHARED written after its prompt
    assert index.place(SHARED + [5], [1], set()) == Placement(1, 0, 3 * PAGE)


def test_eviction_is_least_recently_used_among_the_rows_a_step_computes_anyway():
    index = PrefixIndex(n_slots=8, n_local=8)
    for slot, first in enumerate([1, 2, 3, 4, 5]):  # slots 0-4 written in this order
        assert index.place([first] * 2 * PAGE, list(range(slot, 8)), set(), cheap_rows=1).slot == slot
        index.hold(slot, [first] * 2 * PAGE)
    index.hold(0, [1] * 3 * PAGE)  # slot 0's request ended last: its blocks are the most recently used
    # Rows 0-3 cost nothing more (a step computes 4 rows): the least recently used of them, slot 1, is evicted; slot
    # 4, older still, is not taken, as it would make steps compute more rows.
    assert index.place([9] * 2 * PAGE, [0, 1, 2, 3, 4, 5], set(), cheap_rows=4) == Placement(1, 1, 0)
    assert not index.holders.get(block_names([2] * 2 * PAGE)[0])
    # A prefix held by a free slot in those rows is reused in place, even where an older slot is free beside it.
    assert index.place([3] * 2 * PAGE + [7], [0, 2, 3, 4], set(), cheap_rows=4) == Placement(2, 2, 2 * PAGE)
    # With none of those rows free, the engine's first free slot is taken as before (here slot 4, holding it).
    assert index.place([5] * 2 * PAGE + [7], [4, 5, 6, 7], set(), cheap_rows=4) == Placement(4, 4, 2 * PAGE)
