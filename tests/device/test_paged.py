"""The paged KV cache on the chip against the CPU: the paged programs' greedy tokens are the CPU slot sampler's (f32,
bf16-valued pages) or the CPU's own paged ones (int8 pages), with the pure-JAX gather and with the TPU paged attention
kernel (`Policy.paged_attention`: on a TPU the kernel itself; on a CPU-backed run of the tier, Pallas' TPU
interpreter; a GPU runs the gather alone, as its policy does). Two heads of 128.

int8 pages amplify the last bits in which the chip's f32 arithmetic differs from the CPU's: a key that moves by one
f32 rounding can cross a rounding boundary of its int8 value and move by a quantization step, which moves the logits
by about 1e-3. So where int8 tokens part, the first parting must be at a near-tie: a position where the f32
model's top two logits are within INT8_TIE (on a v5e, gather and kernel alike: one row of four parts, at step 8,
where the top two are 0.0023 apart)."""
import contextlib
import dataclasses

import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mesh_transformer import platforms
from mesh_transformer.infer import decode, params as infer_params, sampler as sampling
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.programs import Programs
from tests.device.model import CFG
from tests.device.test_numerics import fed_tokens, infer_layout, train_layout, with_dtypes

PAGE, STEPS = 8, 12
INT8_TIE = 0.05
PROMPT_LENGTHS = [16, 3, 9, 12]
# The TPU kernel runs on a TPU, and in Pallas' TPU interpreter on the CPU; not on a GPU.
ATTENTIONS = ["gather"] + (["kernel"] if platforms.expected_platform() != platforms.GPU else [])


def paged_greedy(cfg, params, device, attention: str, prompts: list[list[int]]) -> np.ndarray:
    """Greedy tokens [rows, 1 + STEPS] through Programs' paged prefill and decode on one device, each row's pages
    its own (shuffled), the decode attention `attention`."""
    layout = infer_layout(cfg, device)
    layout = dataclasses.replace(layout, policy=dataclasses.replace(layout.policy, paged_attention=attention))
    programs, rows, width = Programs(layout), len(prompts), cfg.seq // PAGE
    table = np.random.default_rng(0).permutation(rows * width).reshape(rows, width).astype(np.int32)
    cache, slots = programs.new_pages(rows * width, PAGE), programs.new_slots(rows)
    placed = infer_params.place_params(params, layout)
    ids = np.zeros((rows, max(map(len, prompts))), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    length, sampling_R = np.array([len(p) for p in prompts], np.int32), fill_sampling(rows, [])
    token, _, slots, cache = programs.paged_prefill(placed, cache, slots, ids, np.zeros(rows, np.int32), length,
                                                    table, np.arange(rows, dtype=np.int32), sampling_R,
                                                    np.zeros(rows, np.int32), n_read=0)
    steps, tokens = decode.Steps(length, np.ones(rows, np.int32), sampling_R), [np.asarray(token)]
    for _ in range(STEPS):
        n_read = -(-int(np.max(steps.position) + 1) // PAGE)
        n_read = next(n for n in (1, 2, 4, width) if n >= n_read)
        token, _, slots, steps, cache = programs.paged_decode(placed, cache, slots, steps, table, rows=rows,
                                                              n_read=n_read)
        tokens.append(np.asarray(token))
    return np.stack(tokens, 1)


@pytest.fixture(scope="module")
def params():
    from tests.device.model import trained_scale_params

    return trained_scale_params(CFG)


@pytest.mark.parametrize("kv", ["compute", "int8"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_paged_greedy_tokens_on_the_chip_are_the_cpus(params, chip, host, attention, kv):
    cfg = dataclasses.replace(with_dtypes("float32"), n_heads=2, kv_cache_dtype=kv)
    prompts = [list(p[:n]) for p, n in zip(fed_tokens()[0], PROMPT_LENGTHS)]
    interpreted = attention == "kernel" and chip.platform == "cpu"  # the tier run on the CPU: the TPU interpreter
    with jax.default_matmul_precision("highest"):
        with pltpu.force_tpu_interpret_mode() if interpreted else contextlib.nullcontext():
            on_chip = paged_greedy(cfg, params, chip, attention, prompts)
        if kv == "compute":
            results = sampling.Sampler(infer_layout(cfg, host), params).generate(
                prompts, STEPS + 1, temperature=0.0, stop_token_ids=[])
            on_cpu = np.array([r.tokens for r in results])
        else:
            on_cpu = paged_greedy(cfg, params, host, "gather", prompts)
            assert_parted_at_near_ties(cfg, params, host, prompts, on_chip, on_cpu)
            return
    np.testing.assert_array_equal(on_chip, on_cpu)


def assert_parted_at_near_ties(cfg, params, host, prompts, on_chip, on_cpu) -> None:
    """Each row's tokens are the same up to where they first differ, if they do, and there the f32 model's top two
    logits (the CPU's forward over the prompt and the tokens before) are within INT8_TIE."""
    layout = train_layout(cfg, host)
    logits_fn, placed = layout.logits_fn(), jax.device_put(params, layout.param_shardings())
    for prompt, chip_row, cpu_row in zip(prompts, on_chip, on_cpu):
        parted = np.flatnonzero(chip_row != cpu_row)
        if parted.size:
            context = np.array([prompt + cpu_row[:parted[0]].tolist()], np.int32)
            top2 = np.sort(np.asarray(logits_fn(placed, context))[0, -1])[-2:]
            assert top2[1] - top2[0] < INT8_TIE, (
                f"int8 tokens part at step {parted[0]}, where the top two logits are {top2[1] - top2[0]:.3g} apart")
            print(f"int8 tokens part at step {parted[0]}: top two logits {top2[1] - top2[0]:.3g} apart")
