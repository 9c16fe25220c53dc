"""bench/paged_kernel_bench.py, at a small shape in Pallas' TPU interpreter: it runs (so a chip session's call does
not find it broken) and its kernel agrees with its f32 reference, in each form, over grouped heads and rows of
different lengths; its floors run too."""
import pytest
from jax.experimental.pallas import tpu as pltpu

from bench import paged_kernel_bench as bench


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_the_kernel_bench_measures_the_kernel_against_its_reference(monkeypatch, int8):
    monkeypatch.setitem(bench.SHAPES, "small", (3, 4, 2, 128, 40))  # rows, heads, key heads, head dim, positions
    with pltpu.force_tpu_interpret_mode():
        records = [bench.variant("small", 16, 32, int8, form, repeats=1, spread=spread)
                   for form, spread in (("dense", False), ("mxu", True), ("copy", True))]
    assert [r["pages_per_block"] for r in records] == [2, 2, 2]
    assert all(r["kv"] == ("int8" if int8 else "bfloat16") and r["ms"] > 0 for r in records)
    # every row 40 positions (3 pages of 16); spread: 26, 39 and 53 (2, 3 and 4 pages), as many in all
    assert [r["bytes_read"] * 1.0 / records[0]["bytes_read"] for r in records] == [1.0, 1.0, 1.0]
    # the kernel's bf16 operands and probabilities against the f32 reference: 1.2e-3 and 1.8e-3 measured here
    assert records[0]["max_abs_error"] < 1e-2 and records[1]["max_abs_error"] < 1e-2
    assert records[2]["max_abs_error"] is None  # a floor computes nothing to compare
