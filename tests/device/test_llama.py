"""The Llama family on the chip against the CPU on the same weights: RMSNorm, SwiGLU, rotary by halves over the whole
head, grouped-query attention (4 query heads on each of 2 key heads, heads of 128 as the TPU kernels take them):
forward logits; greedy sampling through the slot sampler (the decode kernel on the chip) and through the paged
programs (the paged kernel and the gather). Tolerances as in test_numerics."""
import contextlib
import dataclasses

import jax
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from mesh_transformer import config
from mesh_transformer.infer import sampler as sampling
from tests.device.model import trained_scale_params
from tests.device.test_numerics import BATCH, DTYPES, compare, infer_layout, on_both, train_layout
from tests.device.test_paged import ATTENTIONS, STEPS, paged_greedy

LLAMA = {"family": "llama", "layers": 3, "d_model": 1024, "n_heads": 8, "n_kv_heads": 2, "intermediate_size": 1536,
         "n_vocab": 1024, "pe_rotary_dims": 128, "rotary_base": 500000.0, "seq": 64, "cores_per_replica": 1,
         "remat": False}
PROMPT_LENGTHS = [16, 3, 9, 12]


def llama(dtype: str = "float32") -> config.Config:
    return config.from_dict({**LLAMA, "compute_dtype": dtype})


@pytest.fixture(scope="module")
def params():
    return trained_scale_params(llama(), seed=8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_llama_forward_logits_on_the_chip_equal_the_cpus(params, chip, host, dtype):
    cfg = llama(dtype)
    tokens_BxT = np.random.default_rng(9).integers(0, cfg.n_vocab, (BATCH, cfg.seq)).astype(np.int32)

    def logits(cfg, device):
        layout = train_layout(cfg, device)
        return layout.logits_fn()(jax.device_put(params, layout.param_shardings()), tokens_BxT)

    compare(dtype, *(x.reshape(-1, cfg.n_vocab) for x in on_both(logits, cfg, chip, host)))


@pytest.mark.parametrize("attention", ["slots", *ATTENTIONS])
def test_llama_greedy_tokens_on_the_chip_are_the_cpus(params, chip, host, attention):
    """f32: the chip's greedy tokens, from the slot sampler or the paged programs, are the CPU slot sampler's."""
    cfg = llama()
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, cfg.n_vocab, n).tolist() for n in PROMPT_LENGTHS]

    def slot_greedy(device) -> np.ndarray:
        results = sampling.Sampler(infer_layout(cfg, device), params).generate(
            prompts, STEPS + 1, temperature=0.0, stop_token_ids=[])
        return np.array([r.tokens for r in results])

    interpreted = attention == "kernel" and chip.platform == "cpu"  # the tier run on the CPU: the TPU interpreter
    with jax.default_matmul_precision("highest"):
        with pltpu.force_tpu_interpret_mode() if interpreted else contextlib.nullcontext():
            on_chip = (slot_greedy(chip) if attention == "slots"
                       else paged_greedy(dataclasses.replace(cfg), params, chip, attention, prompts))
        on_cpu = slot_greedy(host)
    np.testing.assert_array_equal(on_chip, on_cpu)
