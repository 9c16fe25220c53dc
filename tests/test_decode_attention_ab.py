"""bench/decode_attention_ab.py, at a small shape in Pallas' TPU interpreter: it runs (so a chip session's call does
not find it broken), and XLA's attention and each kernel variant agree with its f32 reference."""
import json
import sys

import pytest
from jax.experimental.pallas import tpu as pltpu

from bench import decode_attention_ab as ab


def test_the_ab_times_xlas_attention_and_the_kernels_against_the_reference(monkeypatch, capsys):
    monkeypatch.setattr(ab, "HEAD_DIM", 128)
    monkeypatch.setattr(ab, "CHAINED", 2)
    monkeypatch.setattr(sys, "argv", ["decode_attention_ab.py", "--layers", "2", "--slots", "8", "--rows", "4",
                                      "--blocks", "16,8", "--kernel-variants", "vpu:2x8"])
    with pltpu.force_tpu_interpret_mode():
        ab.main()
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records[0]["bench"] == "decode_attention_meta" and records[0]["blocks"] == [16, 8]
    runs = [(r["variant"], r["rows"]) for r in records[1:]]
    assert runs == [(v, 4) for v in ("xla", "kernel", "kernel_vpu:2x8")]
    for r in records[1:]:
        assert r["step_ms"] > 0 and r["kv_gb"] == pytest.approx(2 * 2 * r["rows"] * 24 * 16 * 128 * 2 / 1e9, rel=1e-3)
        # bf16 caches: XLA's probabilities and sums in bf16 (1e-2 measured), the kernel's in f32 (its mxu form's
        # probabilities in bf16)
        assert r["max_abs_error"] < 0.05
