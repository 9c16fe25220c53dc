"""Reads ahead of their use: results in order, a bounded number read beyond the one in use, an error where its
result would have been, nothing more read once the user stops; and how many layers a loader reads ahead."""
import time

import pytest

from mesh_transformer import config
from mesh_transformer.store import readahead


def _until(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < end:
        time.sleep(0.005)
    return predicate()


def _reads(n: int, done: list, fail_at: int | None = None) -> list:
    def read(i: int):
        if i == fail_at:
            raise ValueError(f"read {i} failed")
        done.append(i)
        return i

    return [lambda i=i: read(i) for i in range(n)]


def test_results_come_in_order_while_at_most_ahead_more_are_read():
    done: list = []
    got = []
    for i in readahead.read_ahead(_reads(8, done), ahead=2):
        # The thread reads on while this one is in use, and no further: a read is submitted only as one is taken.
        assert _until(lambda i=i: len(done) == min(8, i + 3))
        got.append(i)
    assert got == done == list(range(8))


def test_a_failed_read_raises_where_its_result_would_have_been():
    got = []
    with pytest.raises(ValueError, match="read 3 failed"):
        for i in readahead.read_ahead(_reads(6, [], fail_at=3), ahead=2):
            got.append(i)
    assert got == [0, 1, 2]


def test_nothing_more_is_read_once_the_user_stops():
    done: list = []
    reads = readahead.read_ahead(_reads(10, done), ahead=2)
    assert next(reads) == 0 and _until(lambda: len(done) == 3)
    reads.close()  # returns once the reading thread has stopped
    assert done == [0, 1, 2]


def test_gptj_6b_in_bf16_reads_two_layers_ahead_and_a_layer_over_the_budget_one():
    six_b = config.load("configs/6B_roto_256.json")
    assert readahead.depth(six_b, "bfloat16") == 2
    assert readahead.depth(config.from_dict({**six_b.to_dict(), "d_model": 8192, "n_heads": 32}), "float32") == 1
