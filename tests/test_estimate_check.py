"""bench/estimate_check.py sets each estimate beside the newest matching measurement of a results file."""
from bench.estimate_check import newest


def test_the_newest_matching_record_with_a_step_time_and_its_runs_commit():
    records = [{"bench": "meta", "git_commit": "a"}, {"bench": "decode", "batch": 1, "step_s": 0.02},
               {"bench": "decode", "batch": 2, "step_s": 0.03},
               {"bench": "meta", "git_commit": "b"}, {"bench": "decode", "batch": 1, "step_s": 0.01},
               {"bench": "decode", "batch": 1, "error": "out of memory"},
               {"bench": "train", "splash_block": None, "step_s": 1.0}]
    assert newest(records, bench="decode", batch=1) == (records[4], "b")
    assert newest(records, bench="decode", batch=2) == (records[2], "a")
    assert newest(records, bench="train", splash_block=(512, None)) == (records[6], "b")  # any of a tuple's values
    assert newest(records, bench="decode", batch=3) == (None, None)
