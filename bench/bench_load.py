"""Reading a checkpoint for inference: a random mid-size GPT-J in the original slim layout (8 shards, bf16) written to
--work with a LoRA run over it (and, with --formats, the same model as ours and as an HF directory), read once to warm
the page cache, then read by `infer.load.read_for_inference` as the sampling and serving tools read it: in bf16 and in
int8, without adapters and with the run's, on the CPU's host path and on the accelerators' device path (forced here:
the host reads, the devices merge, join, convert and quantize); and by the checkpoint's reader alone, nothing placed.
Each case runs in a child process of its own, with the tools' malloc settings; a JSON line each: the checkpoint's
bytes read a second (the base's files), the seconds, the CPU seconds of all its threads, the peak resident memory.

    python bench/bench_load.py --work /tmp/bench_load [--formats original,ours,hf] [--loading reader,host,devices]
        [--only bf16,int8] [--layers 10 --d-model 2048] [--repeats 3] [--no-lora]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the cases measure the host path and the device path on the CPU

from bench.bench_6b_flow import WRITE_ORIGINAL  # noqa: E402
from bench.common import emit, figure  # noqa: E402

LORA_RANK = 8
DTYPES = ("bf16", "int8")
FORMATS = ("original", "ours", "hf")
LOADINGS = ("reader", "host", "devices")  # the reader alone; the CPU's path; the accelerators' path


def model_config(layers: int, d_model: int) -> dict:
    """GPT-J-6B's shape at `layers` and `d_model` (its heads of 256 dims kept where they divide)."""
    return {"layers": layers, "d_model": d_model, "n_heads": max(1, d_model // 256), "n_vocab": 50400,
            "pe_rotary_dims": 64, "seq": 2048, "cores_per_replica": 8}


def write(work: str, raw: dict, formats: list[str]) -> tuple[dict[str, str], str]:
    """({format: the checkpoint in it}, the LoRA run over the original), written unless already there; ours and HF
    converted from the original, in bf16."""
    from mesh_transformer import config
    from mesh_transformer.model import lora
    from mesh_transformer.store import checkpoint, convert, hf_export
    import jax
    import numpy as np

    step_dir, run = f"{work}/original/step_1", f"{work}/lora_run"
    paths = {"original": step_dir, "ours": f"{work}/ours", "hf": f"{work}/hf"}
    config_path = f"{work}/original/config.json"
    if not os.path.exists(f"{step_dir}/shard_7/15.npz"):
        os.makedirs(f"{work}/original", exist_ok=True)
        with open(config_path, "w") as f:
            json.dump(raw, f)
        script = WRITE_ORIGINAL.format(root=ROOT, config=config_path, step_dir=step_dir)
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if not os.path.exists(run):
        cfg = config.from_dict({**raw, "lora_rank": LORA_RANK, "lora_alpha": 2 * LORA_RANK})
        rng = np.random.default_rng(1)
        adapters = jax.tree.map(lambda s: (rng.standard_normal(s.shape, np.float32) * 0.02), lora.lora_shapes(cfg))
        checkpoint.save(run, 5, {"step": np.int32(5), "params": adapters},
                        {"config": cfg.to_dict(), "lora_base": {"path": step_dir}}, blocking=True)
    cfg = config.from_dict(raw)
    if "ours" in formats and not os.path.exists(paths["ours"]):
        convert.write_checkpoint(step_dir, cfg, paths["ours"], dtype="bf16", slim=True)
    if "hf" in formats and not os.path.exists(paths["hf"]):
        hf_export.write_hf(step_dir, cfg, paths["hf"], dtype="bf16")
    return {name: paths[name] for name in formats}, run


def checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(path) for name in names)


def warm(path: str) -> None:
    """Every file of `path` read once, so the cases read from the page cache."""
    for d, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                while f.read(64 << 20):
                    pass


CASE = """
import argparse, dataclasses, json, sys, time
import numpy as np
sys.path.insert(0, {root!r})
from mesh_transformer import config, platforms
platforms.keep_host_memory()
from mesh_transformer.infer import load, params
from mesh_transformer.model import table
from mesh_transformer.store import convert
raw, source, lora, dtype, loading = json.loads(sys.argv[1])
cfg = config.from_dict({{**raw, **config.INFERENCE_DTYPES[dtype]}})
start, start_cpu = time.perf_counter(), time.process_time()
if loading == "reader":  # the checkpoint's reader alone, each param and layer in turn, nothing placed
    with convert.open_params(source, cfg) as reader:
        for path, _ in table.param_paths(cfg):
            for i in range(cfg.layers) if path[0] == "layers" else [None]:
                x = reader.read(path, i)
                if isinstance(x, np.memmap):  # an HF tensor: its pages read
                    np.array(x, order="K")
else:
    layout = params.make_inference_layout(cfg)
    layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, host_loading=loading == "host"))
    load.read_for_inference(layout, source, argparse.Namespace(lora=lora))
print(json.dumps({{"read_s": time.perf_counter() - start, "cpu_s": time.process_time() - start_cpu}}))
"""


def case(raw: dict, source: str, lora: str | None, dtype: str, loading: str) -> dict:
    """One read in a child process: its seconds and the child's peak resident memory."""
    argv = [sys.executable, "-c", CASE.format(root=ROOT), json.dumps([raw, source, lora, dtype, loading])]
    child = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"case {dtype} {loading} lora={lora} failed")
    return {**json.loads(out.strip().splitlines()[-1]), "peak_rss_gb": figure(usage.ru_maxrss * 1024 / 1e9, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, help="where the checkpoint is written (about 1.5 GB)")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--only", default=",".join(DTYPES), help=f"dtypes of {','.join(DTYPES)}")
    parser.add_argument("--loading", default=",".join(LOADINGS), help=f"of {','.join(LOADINGS)}")
    parser.add_argument("--formats", default="original", help=f"of {','.join(FORMATS)}")
    parser.add_argument("--repeats", type=int, default=1, help="reads of each case (each in a child of its own)")
    parser.add_argument("--no-lora", action="store_true", help="the cases without adapters only")
    args = parser.parse_args()
    raw = model_config(args.layers, args.d_model)
    start = time.perf_counter()
    sources, run = write(os.path.abspath(args.work), raw, args.formats.split(","))
    emit(bench="load_write", wall_s=figure(time.perf_counter() - start, 3))
    for form, source in sources.items():
        size = checkpoint_bytes(source)
        warm(source)
        warm(run)
        for dtype in args.only.split(","):
            for loading in args.loading.split(","):
                for lora in (None,) if loading == "reader" or args.no_lora else (None, run):
                    for _ in range(args.repeats):
                        got = case(raw, source, lora, dtype, loading)
                        emit(bench="load", format=form, checkpoint_gb=figure(size / 1e9), dtype=dtype,
                             loading=loading, lora=lora is not None, read_s=figure(got["read_s"], 3),
                             gb_per_s=figure(size / 1e9 / got["read_s"], 3), cpu_s=figure(got["cpu_s"], 3),
                             peak_rss_gb=got["peak_rss_gb"])


if __name__ == "__main__":
    main()
