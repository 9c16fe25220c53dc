"""One program of the fit check (aot.py) compiled for its target from abstract arguments, and what it needs of a
device: the compiler's memory analysis, or the need the compiler stated where it refused the program for want of
memory. Nothing is allocated.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

import jax
import jax.numpy as jnp

from mesh_transformer import platforms


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs (the largest shard of each leaf; without a sharding,
    all of it)."""
    def leaf_bytes(s):
        shape = s.shape if s.sharding is None else s.sharding.shard_shape(s.shape)
        return jnp.dtype(s.dtype).itemsize * math.prod(shape)

    return sum(leaf_bytes(s) for s in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class Refused:
    """A program the target's compiler refused for want of device memory (XLA:TPU does, where XLA:CPU compiles
    anything): what it said, the arguments' bytes and the temporaries beyond them that it said it needed."""
    message: str
    argument_bytes: int
    temp_bytes: int


_UNIT_BYTES = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def refusal(e: jax.errors.JaxRuntimeError, args: tuple) -> Refused | None:
    """The Refused of a compile that failed for want of device memory (the compiler's RESOURCE_EXHAUSTED), with
    these arguments; None for any other failure."""
    if "RESOURCE_EXHAUSTED" not in str(e):
        return None
    message = next((line.strip() for line in str(e).splitlines() if line.strip()), str(e))
    # XLA:TPU's "memory required for HLO temporaries" is the program's whole need, its arguments included.
    need = re.search(r"HLO temporaries \(([\d.]+)([KMGT])\)", message)
    arguments = shard_bytes([x for x in jax.tree.leaves(args) if isinstance(x, jax.ShapeDtypeStruct)])
    need_bytes = int(float(need.group(1)) * _UNIT_BYTES[need.group(2)]) if need else arguments
    return Refused(message, arguments, max(0, need_bytes - arguments))


def _compile(fn, *args, policy: platforms.Policy, **static) -> tuple[object, float]:
    """`fn` lowered for these arguments and compiled under the policy's options: the compiled program (a Refused
    where the compiler ran out of device memory) and the seconds it took."""
    start = time.perf_counter()
    options = policy.compiler_options()
    if policy.platform == platforms.CPU:
        # Only XLA's buffer assignment matters here, which comes before code generation: skip LLVM's optimizations.
        options["xla_backend_optimization_level"] = 0
    try:
        compiled = fn.lower(*args, **static).compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:
        compiled = refusal(e, args)
        if compiled is None:
            raise
    return compiled, time.perf_counter() - start


def memory_record(compiled) -> dict[str, float]:
    """A compiled program's (or a refusal's) per-device bytes, as a record's fields."""
    if isinstance(compiled, Refused):
        return {"argument_bytes": compiled.argument_bytes, "output_bytes": 0, "alias_bytes": 0,
                "temp_bytes": compiled.temp_bytes, "total_bytes": compiled.argument_bytes + compiled.temp_bytes,
                "code_bytes": 0, "refused": compiled.message}
    mem = compiled.memory_analysis()
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
             - mem.alias_size_in_bytes)
    return {"argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes, "total_bytes": total,
            "code_bytes": mem.generated_code_size_in_bytes}


def size_text(n_bytes: int) -> str:
    """Bytes as a person reads them: GiB, MiB, KiB or B, two decimals."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes} B"
