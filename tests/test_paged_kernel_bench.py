"""bench/paged_kernel_bench.py, at a small shape in Pallas' TPU interpreter: it runs (so a chip session's call does
not find it broken) and its kernel agrees with its f32 reference."""
import pytest
from jax.experimental.pallas import tpu as pltpu

from bench import paged_kernel_bench as bench


@pytest.mark.parametrize("int8", [True, False], ids=["int8", "bf16"])
def test_the_kernel_bench_measures_the_kernel_against_its_reference(monkeypatch, int8):
    monkeypatch.setattr(bench, "ROWS", 3)
    monkeypatch.setattr(bench, "HEADS", 2)
    monkeypatch.setattr(bench, "HEAD_DIM", 128)
    monkeypatch.setattr(bench, "POSITIONS", 40)
    with pltpu.force_tpu_interpret_mode():
        record = bench.variant(16, 32, int8, repeats=1)
    assert record["pages_per_block"] == 2 and record["kv"] == ("int8" if int8 else "bfloat16")
    assert record["ms"] > 0 and record["bytes_read"] > 0
    # the kernel's bf16 operands and probabilities against the f32 reference: 1.2e-3 and 1.8e-3 measured here
    assert record["max_abs_error"] < 1e-2
