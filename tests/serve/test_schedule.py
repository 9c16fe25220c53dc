"""The serving engine's scheduling policy, without a device: slot order, prefill grouping, decode program shapes."""
from mesh_transformer.infer.decode import block_sizes
from mesh_transformer.serve.schedule import MAX_PREFILL_ROWS, PREFILL_TOKENS, Schedule

SEQ = 256
TWO_GROUPS = Schedule(n_slots=8, dp=2, seq=SEQ, block_sizes=tuple(block_sizes(SEQ, 64)))


def test_free_slots_are_taken_lowest_row_of_each_group_first():
    assert TWO_GROUPS.admission_order([7, 0, 4, 1, 5]) == [0, 4, 1, 5, 7]


def test_a_prefill_puts_each_group_s_requests_in_its_own_rows():
    ((rows, width, placed),) = TWO_GROUPS.prefill_batches({0: 10, 1: 30, 4: 5})
    assert rows == 4 and width == 32  # two rows in group 0 padded to the ladder's 4; the longest prompt's bucket
    assert placed == [(0, 0), (1, 1), (4, 4)]  # group 1 starts at row 1 x rows


def test_long_prompts_are_prefilled_fewer_at_a_time():
    schedule = Schedule(n_slots=32, dp=1, seq=4096, block_sizes=(1024,) * 4)
    batches = schedule.prefill_batches({slot: 1500 for slot in range(6)})
    assert all(rows * width <= PREFILL_TOKENS or rows == 1 for rows, width, _ in batches)
    assert sorted(slot for _, _, placed in batches for slot, _ in placed) == list(range(6))
    many = schedule.prefill_batches({slot: 3 for slot in range(MAX_PREFILL_ROWS + 2)})
    assert [len(placed) for _, _, placed in many] == [MAX_PREFILL_ROWS, 2]


def test_a_decode_step_computes_rows_up_to_the_highest_busy_one_and_blocks_up_to_the_furthest():
    rows, n_blocks, out_rows = TWO_GROUPS.decode({1: 10, 5: 70})
    assert (rows, n_blocks) == (4, 2)  # row 1 of each group padded to 4; position 70 lies in the second block
    assert out_rows == {1: 1, 5: 4 + 1}
    assert TWO_GROUPS.decode({0: 200})[:2] == (1, 4)


def test_the_rows_a_step_computes_anyway_are_the_cheap_ones_for_an_admission():
    assert TWO_GROUPS.cheap_rows([]) == 1  # nothing busy: row 0 alone
    assert TWO_GROUPS.cheap_rows([5]) == TWO_GROUPS.decode({5: 0})[0] == 4  # row 1 of group 1: steps compute 4 rows
    assert TWO_GROUPS.cheap_rows([0, 4]) == 1
