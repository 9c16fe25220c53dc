"""A/B of the forms a decode step's weight products can take on the device this machine has: GPT-J-6B's two joined
matrices of a layer (`fused.fuse_layer`: in [3D + F, D], out [D, D + F]) for a few layers, run as decode runs them
(each layer's input product, then its output product, one batch of rows), in bf16 and int8, the weights held
[outputs, inputs] (as now) or [inputs, outputs], the int8 ones converted before XLA's dot, given to the dot as they
are, multiplied as int8 by the rows quantized too (w8a8) or split into two int8 halves (split16), or read by a Pallas
kernel a block at a time (`pallas_int`: converted there, or as int8 x int8 w8a8 or split16; `pallas_tn`: the weights
as the product's streamed operand; `int8_nk_packed32`: the int8s packed four to an int32 word, unpacked by shifts;
`int8_kn_vpu`: one row on the vector unit; `int8_nk_kernel`: the project's, model/quant_kernel.py). Each record:
the step time (of CHAINED steps back to back), the weight bytes it read over that time, and that rate over the
datasheet's bandwidth where one is known. `--copies` first times an `x + 1` pass over one layer's input matrix as
int8, int32 and bf16.

    python bench/weight_stream_ab.py [--layers 8] [--batches 1,16,32,64] [--variants all] [--copies]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import best_time_s, datasheet, emit, figure

D, F = 4096, 16384
F32, BF16 = jnp.float32, jnp.bfloat16


def _nt(x, w_NxK):
    return lax.dot_general(x, w_NxK, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=F32)


def _nn(x, w_KxN):
    return lax.dot_general(x, w_KxN, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=F32)


def plain(x, w, s, nk):
    return (_nt if nk else _nn)(x, w)


def convert(x, w, s, nk):
    return (_nt if nk else _nn)(x, w.astype(x.dtype)) * s[None]


def mixed(x, w, s, nk):
    return (_nt if nk else _nn)(x, w) * s[None]


def _rows_int8(q, rows: int):
    """int8 rows padded to a whole int8 tile of sublanes (32), as Mosaic lays them out."""
    return jnp.pad(q, ((0, rows - q.shape[0]), (0, 0))).astype(jnp.int8)


def pallas_int(x, w, s_N, nk: bool, mode: str, block_bytes: int = 4 << 20, interpret: bool = False):
    """x @ w (w int8, [N, K] if nk else [K, N]) in a Pallas kernel whose grid walks blocks of w's outputs; `mode`
    "convert": each block converted to x's dtype for a bf16 product; "w8a8": the rows quantized to int8 (a scale
    each) for an int8 x int8 product; "split16": the rows as 16-bit fixed point in two int8 halves (q = 256 hi + lo)
    stacked as one int8 x int8 product of twice the rows, the halves recombined in f32. No block is converted in the
    int8 modes: the matrix unit takes the weights as they are read."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, k = (w.shape if nk else w.shape[::-1])
    b = x.shape[0]
    bn = max(128, min(n, (block_bytes // (k * w.dtype.itemsize)) // 128 * 128))
    while n % bn:
        bn -= 128
    rows = -(-b // 32) * 32
    sx = None
    if mode == "convert":
        lhs = x
    else:
        xf = x.astype(F32)
        top = 127 if mode == "w8a8" else SPLIT_MAX
        sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / top + 1e-30
        q = jnp.round(xf / sx).astype(jnp.int32)
        if mode == "w8a8":
            lhs = _rows_int8(q, rows)
        else:
            hi = jnp.floor_divide(q + 128, 256)
            lhs = jnp.concatenate([_rows_int8(hi, rows), _rows_int8(q - 256 * hi, rows)])
    dims = (((1,), (1 if nk else 0,)), ((), ()))

    def kernel(x_ref, w_ref, s_ref, o_ref):
        if mode == "convert":
            acc = lax.dot_general(x_ref[...], w_ref[...].astype(x_ref.dtype), dims, preferred_element_type=F32)
        else:
            acc = lax.dot_general(x_ref[...], w_ref[...], dims, preferred_element_type=jnp.int32).astype(F32)
            if mode == "split16":
                acc = 256.0 * acc[:rows] + acc[rows:]
        o_ref[...] = acc * s_ref[...]

    out_rows = b if mode == "convert" else rows
    out = pl.pallas_call(
        kernel, grid=(n // bn,),
        in_specs=[pl.BlockSpec(lhs.shape, lambda j: (0, 0)),
                  pl.BlockSpec((bn, k), lambda j: (j, 0)) if nk else pl.BlockSpec((k, bn), lambda j: (0, j)),
                  pl.BlockSpec((1, bn), lambda j: (0, j))],
        out_specs=pl.BlockSpec((out_rows, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((out_rows, n), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20),
        interpret=interpret)(lhs, w, s_N.reshape(1, n))
    return out if sx is None else out[:b] * sx


def pallas_tn(x, w_NxK, s_N, block_bytes: int = 4 << 20, interpret: bool = False):
    """x @ w.T as (w @ x.T).T in a Pallas kernel: each int8 block of w, converted, is the product's streamed operand
    and the rows (padded to 128 lanes) the held one, so the matrix unit never loads the weights as its matrix."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, k = w_NxK.shape
    b = x.shape[0]
    bn = max(128, min(n, (block_bytes // k) // 128 * 128))
    while n % bn:
        bn -= 128
    lanes = -(-b // 128) * 128
    x_KxB = jnp.pad(x, ((0, lanes - b), (0, 0))).T

    def kernel(x_ref, w_ref, s_ref, o_ref):
        acc = lax.dot_general(w_ref[...].astype(x_ref.dtype), x_ref[...], (((1,), (0,)), ((), ())),
                              preferred_element_type=F32)
        o_ref[...] = acc * s_ref[...]

    out = pl.pallas_call(
        kernel, grid=(n // bn,),
        in_specs=[pl.BlockSpec((k, lanes), lambda j: (0, 0)), pl.BlockSpec((bn, k), lambda j: (j, 0)),
                  pl.BlockSpec((bn, 1), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((bn, lanes), lambda j: (j, 0)),
        out_shape=jax.ShapeDtypeStruct((n, lanes), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20),
        interpret=interpret)(x_KxB, w_NxK, s_N.reshape(n, 1))
    return out[:, :b].T


def pack4(w_NxK):
    """An int8 [N, K] as int32 [N, K / 4]: word i of a row holds its int8s i, i + K/4, i + K/2 and i + 3K/4, lowest
    byte first, so the weights stream as 32-bit words (the DMA and tiling of an f32 array) and unpack by shifts."""
    n, k = w_NxK.shape
    parts = w_NxK.reshape(n, 4, k // 4).astype(jnp.int32) & 0xFF
    return parts[:, 0] | (parts[:, 1] << 8) | (parts[:, 2] << 16) | (parts[:, 3] << 24)


def pallas_packed(x, p_NxK4, s_N, block_bytes: int = 4 << 20, interpret: bool = False):
    """x @ w.T for w packed by `pack4`: each block of words read, its four int8s taken out by shifts (VPU work, no
    int8 layout anywhere) and converted, four bf16 products of a quarter of K each summed in f32."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, k4 = p_NxK4.shape
    b = x.shape[0]
    bn = max(128, min(n, (block_bytes // (k4 * 4)) // 128 * 128))
    while n % bn:
        bn -= 128
    x4 = x.reshape(b, 4, k4).transpose(1, 0, 2)  # [4, b, K/4]: the quarter of K each byte of a word holds

    def kernel(x_ref, p_ref, s_ref, o_ref):
        p = p_ref[...]
        acc = jnp.zeros((b, bn), F32)
        for j in range(4):
            w = lax.shift_right_arithmetic(lax.shift_left(p, jnp.int32(24 - 8 * j)), jnp.int32(24))
            acc += lax.dot_general(x_ref[j], w.astype(F32).astype(x_ref.dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=F32)
        o_ref[...] = acc * s_ref[...]

    return pl.pallas_call(
        kernel, grid=(n // bn,),
        in_specs=[pl.BlockSpec((4, b, k4), lambda j: (0, 0, 0)), pl.BlockSpec((bn, k4), lambda j: (j, 0)),
                  pl.BlockSpec((1, bn), lambda j: (0, j))],
        out_specs=pl.BlockSpec((b, bn), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((b, n), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20),
        interpret=interpret)(x4, p_NxK4, s_N.reshape(1, n))


VPU_ROWS = 64  # sublanes of w a VPU step multiplies into its accumulator


def pallas_vpu(x, w_KxN, s_N, block_n: int = 512, interpret: bool = False):
    """x @ w for one row and an int8 w [K, N] on the vector unit, no matrix unit: each block of outputs accumulates
    x[k] * w[k, :] over K in f32, x held lane-broadcast [K, 128] in VMEM, summed over sublanes at the end."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    k, n = w_KxN.shape
    if x.shape[0] != 1:
        raise ValueError("the VPU form takes one row")
    x_b = jnp.broadcast_to(x.reshape(k, 1).astype(F32), (k, 128))

    def kernel(x_ref, w_ref, s_ref, o_ref):
        for c in range(block_n // 128):
            def body(i, acc, c=c):
                r = pl.multiple_of(i * VPU_ROWS, VPU_ROWS)
                w = w_ref[pl.ds(r, VPU_ROWS), pl.ds(c * 128, 128)].astype(jnp.int32).astype(F32)
                return acc + x_ref[pl.ds(r, VPU_ROWS), :] * w
            acc = lax.fori_loop(0, k // VPU_ROWS, body, jnp.zeros((VPU_ROWS, 128), F32), unroll=4)
            o_ref[:, pl.ds(c * 128, 128)] = jnp.sum(acc, axis=0, keepdims=True) * s_ref[:, pl.ds(c * 128, 128)]

    return pl.pallas_call(
        kernel, grid=(n // block_n,),
        in_specs=[pl.BlockSpec((k, 128), lambda j: (0, 0)), pl.BlockSpec((k, block_n), lambda j: (0, j)),
                  pl.BlockSpec((1, block_n), lambda j: (0, j))],
        out_specs=pl.BlockSpec((1, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((1, n), F32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20),
        interpret=interpret)(x_b, w_KxN, s_N.reshape(1, n))


def w8a8(x, w, s, nk):
    """The rows quantized to int8 (a scale each), the product int8 x int8 on the matrix unit in int32."""
    xf = x.astype(F32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127 + 1e-30
    q = jnp.round(xf / sx).astype(jnp.int8)
    y = _int_dot(q, w, nk)
    return y.astype(F32) * sx * s[None]


def _int_dot(q, w, nk):
    dims = (((q.ndim - 1,), (1 if nk else 0,)), ((), ()))
    return lax.dot_general(q, w, dims, preferred_element_type=jnp.int32)


SPLIT_MAX = 127 * 256 + 127  # the largest |q| whose two int8 halves stay within [-127, 127] and [-128, 127]


def split16(x, w, s, nk):
    """The rows as 16-bit fixed point (a scale each) split into two int8 halves, q = 256 hi + lo, stacked as one
    batch of twice the rows: one int8 x int8 product reads the weights once, the halves recombined in f32."""
    xf = x.astype(F32)
    sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / SPLIT_MAX + 1e-30
    q = jnp.round(xf / sx).astype(jnp.int32)
    hi = jnp.floor_divide(q + 128, 256)
    lo = q - 256 * hi
    b = x.shape[0]
    y = _int_dot(jnp.concatenate([hi, lo]).astype(jnp.int8), w, nk).astype(F32)
    return (256.0 * y[:b] + y[b:]) * sx * s[None]


def _project_kernel(x, w_NxK, s_N):
    """The project's kernel (model/quant_kernel.py, the policy's int8_dot "kernel"), returning f32 as the others."""
    from mesh_transformer.model import quant_kernel

    return quant_kernel.by_rows(x, w_NxK, s_N).astype(F32)


PACKED = "int8 as int32"  # the weights' dtype in VARIANTS for `pack4`'s words

# name: (weight dtype, [N, K] held, product)
VARIANTS = {
    "bf16_nk": (BF16, True, plain), "bf16_kn": (BF16, False, plain),
    "int8_nk_convert": (jnp.int8, True, convert), "int8_kn_convert": (jnp.int8, False, convert),
    "int8_nk_mixed": (jnp.int8, True, mixed), "int8_kn_mixed": (jnp.int8, False, mixed),
    "int8_nk_w8a8": (jnp.int8, True, w8a8), "int8_kn_w8a8": (jnp.int8, False, w8a8),
    "int8_nk_split16": (jnp.int8, True, split16), "int8_kn_split16": (jnp.int8, False, split16),
    "int8_nk_kernel": (jnp.int8, True, lambda x, w, s, nk: _project_kernel(x, w, s)),
    # Pallas kernels (`pallas_int`): blocks of 2, 4 or 8 MB of the weights, [N, K] (nk) or [K, N] (kn)
    **{f"{dt}_nk_pallas{mb}m": (BF16 if dt == "bf16" else jnp.int8, True,
                                functools.partial(pallas_int, mode="convert", block_bytes=mb << 20))
       for dt, mb in (("bf16", 4), ("int8", 2), ("int8", 4), ("int8", 8))},
    "bf16_kn_pallas4m": (BF16, False, functools.partial(pallas_int, mode="convert")),
    "int8_kn_pallas4m": (jnp.int8, False, functools.partial(pallas_int, mode="convert")),
    **{f"int8_{lay}_pallas_{mode}": (jnp.int8, lay == "nk", functools.partial(pallas_int, mode=mode))
       for mode in ("w8a8", "split16") for lay in ("nk", "kn")},
    "int8_nk_pallas_tn": (jnp.int8, True, lambda x, w, s, nk: pallas_tn(x, w, s)),
    "int8_nk_packed32": (PACKED, True, lambda x, w, s, nk: pallas_packed(x, w, s)),
    "int8_nk_packed32_8m": (PACKED, True, lambda x, w, s, nk: pallas_packed(x, w, s, 8 << 20)),
    "int8_kn_vpu": (jnp.int8, False, lambda x, w, s, nk: pallas_vpu(x, w, s)),
}


def make_weights(dtype, nk: bool, layers: int) -> list:
    """Each layer's two matrices, values from a hash of their position (made on the device, fast at any size)."""
    shapes = [(3 * D + F, D), (D, D + F)]  # [N, K] of in and out
    out = []
    for i in range(layers):
        layer = []
        for j, (n, k) in enumerate(shapes):
            shape = (n, k) if nk else (k, n)
            w = jax.jit(functools.partial(_hashed, shape, jnp.int8 if dtype == PACKED else dtype, 2 * i + j))()
            if dtype == PACKED:
                w = jax.jit(pack4)(w)
            layer.append((w, jnp.full((n,), 1.0 if dtype == BF16 else 0.02 / 127, F32)))
        out.append(layer)
    return out


def _hashed(shape, dtype, salt: int):
    bits = (lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(2654435761)
            + lax.broadcasted_iota(jnp.uint32, shape, 1) * jnp.uint32(40503) + jnp.uint32(salt * 7919)) >> 24
    q = bits.astype(jnp.int32) - 128
    return q.clip(-127, 127).astype(jnp.int8) if dtype == jnp.int8 else (q.astype(F32) * 1.5e-4).astype(dtype)


def step(product, nk: bool, x, weights):
    for (w_in, s_in), (w_out, s_out) in weights:
        y = product(x, w_in, s_in, nk).astype(x.dtype)
        o = product(y[:, :D + F], w_out, s_out, nk).astype(x.dtype)
        x = x + o * 1e-3
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--variants", default="all")
    ap.add_argument("--copies", action="store_true", help="first, the rate of an elementwise pass over one layer's "
                    "input matrix as int8, int32 and bf16 (the same bytes), by XLA and by a Pallas copy")
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    device = jax.devices()[0]
    sheet_bytes_per_s = datasheet(device)[1]
    emit(bench="meta", script="weight_stream_ab", device_kind=device.device_kind, jax=jax.__version__,
         commit=os.environ.get("MTJ_COMMIT", "unknown"), layers=args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    if args.copies:
        for record in copy_rates(sheet_bytes_per_s):
            emit(**record)
    for name in names:
        try:
            for record in measure(name, args.layers, batches, sheet_bytes_per_s):
                emit(**record)
        except Exception as e:  # a variant the compiler refuses is a result too
            emit(bench="weight_stream", variant=name, error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")


CHAINED = 10  # steps timed back to back, each taking the last one's output, with one wait at the end


def _chained(fn, x, weights):
    """CHAINED steps dispatched without waiting between them, as decode runs: the time is the device's, not a
    host's round trip a step (about 0.6 ms on one TPU v5e's host, a quarter of an int8 step of 8 layers)."""
    for _ in range(CHAINED):
        x = fn(x, weights)
    return x.block_until_ready()


def measure(name: str, layers: int, batches: list[int], datasheet: float | None):
    """One variant's records, a batch at a time."""
    dtype, nk, product = VARIANTS[name]
    weights = make_weights(dtype, nk, layers)
    n_bytes = sum(w.nbytes + s.nbytes for layer in weights for w, s in layer)
    fn = jax.jit(functools.partial(step, product, nk))
    for b in batches:
        start = time.perf_counter()
        x = jax.random.normal(jax.random.PRNGKey(b), (b, D), F32).astype(BF16)
        t = best_time_s(functools.partial(_chained, fn, x, weights), repeats=5, warmup=1) / CHAINED
        rate = n_bytes / t
        yield dict(bench="weight_stream", variant=name, batch=b, step_ms=figure(t * 1e3),
                   weight_gb=figure(n_bytes / 1e9), bytes_per_s=figure(rate),
                   fraction_of_datasheet=None if datasheet is None else figure(rate / datasheet, 3),
                   wall_s=round(time.perf_counter() - start, 1))

def _pallas_copy(a, block_bytes: int = 4 << 20):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    n, k = a.shape
    bn = max(32, min(n, block_bytes // (k * a.dtype.itemsize) // 32 * 32))
    while n % bn:
        bn -= 32

    def kernel(a_ref, o_ref):
        o_ref[...] = a_ref[...] + jnp.ones((), a.dtype)

    return pl.pallas_call(
        kernel, grid=(n // bn,), in_specs=[pl.BlockSpec((bn, k), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((bn, k), lambda j: (j, 0)), out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=64 << 20))(a)


def _copies(fn, a):
    for _ in range(CHAINED):
        a = fn(a)
    return a.block_until_ready()


def copy_rates(datasheet: float | None):
    """Bytes read and written per second by `a + 1` over one layer's input matrix (GPT-J-6B: [3D + F, D], 117 MB as
    int8), held as int8, as int32 words and as bf16 of the same bytes, by XLA's fusion and by a Pallas kernel."""
    n, k = 3 * D + F, D
    for dtype, cols in ((jnp.int8, k), (jnp.int32, k // 4), (BF16, k // 2)):
        a = jax.jit(lambda cols=cols, dtype=dtype: lax.broadcasted_iota(jnp.int32, (n, cols), 1).astype(dtype))()
        for how, fn in (("xla", jax.jit(lambda a: a + jnp.ones((), a.dtype))), ("pallas", jax.jit(_pallas_copy))):
            try:
                t = best_time_s(functools.partial(_copies, fn, a), repeats=5, warmup=1) / CHAINED
            except Exception as e:
                yield dict(bench="dtype_copy", dtype=jnp.dtype(dtype).name, how=how,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                continue
            rate = 2 * a.nbytes / t
            yield dict(bench="dtype_copy", dtype=jnp.dtype(dtype).name, how=how, shape=[n, cols], ms=figure(t * 1e3),
                       bytes_per_s=figure(rate),
                       fraction_of_datasheet=None if datasheet is None else figure(rate / datasheet, 3))
        del a


if __name__ == "__main__":
    main()
