"""A/B of the compiled programs against a given commit: the bench config's train steps (plain; remat with 4
micro-batches on mp 4 and on fsdp 8; LoRA) and the decode, prefill and sampler-loop programs, compiled by each tree's
own code in child processes; per program, XLA's op counts and memory. Programs equal op for op, with equal
temporaries, cannot differ in speed or memory, whatever a noisy timing says.

    python bench/ab_programs.py COMMIT [--config configs/bench.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OP = re.compile(r"= \S+ (\w[\w-]*)\(")


def describe(compiled) -> dict:
    """Op counts and memory of a compiled program."""
    ops = collections.Counter(_OP.findall(compiled.as_text()))
    mem = compiled.memory_analysis()
    return {"ops": sum(ops.values()), "dots": ops["dot"], "copies": ops["copy"], "fusions": ops["fusion"],
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}


def _train_steps(config_path: str):
    import jax
    import jax.numpy as jnp

    from mesh_transformer import config
    from mesh_transformer.parallel.layout import make_layout
    from mesh_transformer.parallel.mesh import make_dp_mp, make_mesh
    from mesh_transformer.train import optim
    from mesh_transformer.train import state as state_lib

    micro = ["remat=true", "gradient_accumulation_steps=4", "per_replica_batch=1"]
    variants = [("train_plain", ["cores_per_replica=1"], (1, 1), None),
                ("train_accumulated_mp4", micro + ["cores_per_replica=4"], (2, 4), None),
                ("train_accumulated_fsdp8", micro + ["parallelism=fsdp", "mesh_fsdp=8"], None, 8),
                ("train_lora_mp4", micro + ["cores_per_replica=4", "lora_rank=8", "base_dtype=bfloat16"], (2, 4),
                 None)]
    for name, overrides, dp_mp, fsdp in variants:
        cfg = config.load(config_path, overrides)
        mesh = make_dp_mp(*dp_mp) if dp_mp else make_mesh({"data": 1, "fsdp": fsdp, "tensor": 1})
        layout = make_layout(cfg, mesh=mesh)
        optimizer = optim.make_optimizer(cfg)
        abstract = state_lib.abstract_train_state(layout, optimizer)
        tokens = jax.ShapeDtypeStruct((cfg.gradient_accumulation_steps, layout.global_batch, cfg.seq + 1),
                                      jnp.int32, sharding=layout.batch_sharding())
        step = state_lib.make_train_step(layout, optimizer, optim.lr_schedule(cfg))
        frozen = layout.abstract_params(jnp.bfloat16) if cfg.lora_rank else {}
        try:  # a tree whose steps take the frozen tree always
            lowered = step.lower(abstract, tokens, frozen)
        except (TypeError, ValueError):  # one whose full fine-tune step takes none
            lowered = step.lower(abstract, tokens, *([frozen] if cfg.lora_rank else []))
        yield name, lowered.compile()


def _inference(config_path: str):
    import numpy as np

    from mesh_transformer import aot, config
    from mesh_transformer.infer.choose import fill_sampling
    from mesh_transformer.infer.decode import Steps
    from mesh_transformer.infer import params as params_module
    from mesh_transformer.infer.params import make_inference_layout
    try:  # trees before the programs had a module of their own
        from mesh_transformer.infer.programs import Programs
    except ImportError:
        from mesh_transformer.infer.decode import Programs
    from mesh_transformer.parallel.mesh import make_dp_mp

    cfg = config.load(config_path, ["cores_per_replica=1"])
    layout = make_inference_layout(cfg, mesh=make_dp_mp(1, 1))
    # Trees before abstract_params had it in aot.py.
    abstract = getattr(params_module, "abstract_params", None) or aot._abstract_decode_params
    programs, params, n = Programs(layout), abstract(layout), 32
    # Trees before the slots carried penalties: a last token each, no logit bias at a prefill.
    slots = getattr(programs, "new_slots", None) or programs.new_last_tokens
    cache, last = programs.new_cache(n, [64, 64, 128]), slots(n)
    try:
        first = fill_sampling(4, [], bias=True)
    except TypeError:
        first = fill_sampling(4, [])
    steps = Steps(np.zeros(n, np.int32), np.zeros(n, np.int32), fill_sampling(n, []))
    yield "decode_32_rows", programs.jitted["decode"].lower(params, cache, last, steps, rows=n, n_blocks=2).compile()
    ids, ones = np.zeros((4, 64), np.int32), np.ones(4, np.int32)
    yield "prefill_4x64", programs.jitted["prefill"].lower(params, cache, last, ids, ones, ones * 0,
                                                           first).compile()
    yield "sampler_loop_32_rows", programs.jitted["generate"].lower(
        params, cache, last, steps, np.ones(n, bool), np.full(4, -1, np.int32), np.int32(8), rows=n, n_blocks=1,
        out_len=128).compile()


def child(config_path: str) -> None:
    """Print one JSON line per program of this process's tree."""
    for programs in (_train_steps(config_path), _inference(config_path)):
        for name, compiled in programs:
            print(json.dumps({"program": name, **describe(compiled)}), flush=True)


def run_tree(tree: str, config_path: str) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PYTHONPATH")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    # This file, loaded by path, over the tree's own package.
    code = (f"import sys, importlib.util as u; sys.path.insert(0, {tree!r}); "
            f"s = u.spec_from_file_location('ab_programs', {os.path.abspath(__file__)!r}); "
            f"m = u.module_from_spec(s); s.loader.exec_module(m); m.child({config_path!r})")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, stdout=subprocess.PIPE,
                         text=True).stdout
    return {r.pop("program"): r for r in map(json.loads, filter(lambda line: line.startswith("{"),
                                                                 out.splitlines()))}


def main() -> None:
    sys.path.insert(0, ROOT)
    from bench.ab import export_commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit")
    parser.add_argument("--config", default="configs/bench.json")
    args = parser.parse_args()
    base, new = run_tree(export_commit(args.commit), args.config), run_tree(ROOT, args.config)
    for name in new:
        print(json.dumps({"bench": "ab_programs", "base": args.commit, "program": name, "base_figures": base.get(name),
                          "new_figures": new[name], "equal": base.get(name) == new[name]}), flush=True)


if __name__ == "__main__":
    main()
