"""bench/device_suite.py --tiny runs on CPU inside the test suite, so the suite that is run when an accelerator
appears cannot rot unseen."""
import json
import math

from tests.helpers import run_script

SECTIONS = {"device", "train_1p3b", "train_lora_6b", "decode", "serving", "serving_speedup", "compile"}


def numbers(record):
    """Every number in a record, nested ones too (booleans are not figures)."""
    for value in record.values():
        if isinstance(value, dict):
            yield from numbers(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield value


def test_tiny_suite_emits_every_record_with_finite_positive_figures():
    result = run_script("bench/device_suite.py", "--tiny")
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert {r["bench"] for r in records} == SECTIONS
    assert not [r for r in records if "error" in r]
    for record in records:
        figures = list(numbers(record))
        assert figures and all(math.isfinite(x) and x > 0 for x in figures), record
    for weights in ("compute", "int8"):
        assert sorted(r["batch"] for r in records if r["bench"] == "decode" and r["weight_dtype"] == weights) == [1, 4]
    assert {r["mode"] for r in records if r["bench"] == "serving"} == {"concurrent", "one_at_a_time"}
    assert {r["section"] for r in records if r["bench"] == "compile"} == {"device", "train", "train_lora", "decode",
                                                                                   "decode_int8", "serving"}
