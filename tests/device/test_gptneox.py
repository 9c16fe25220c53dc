"""GPT-NeoX on the chip against the CPU on the same weights (issue: the second family on the chip): forward logits
with the parallel residual and without, a quarter of each head rotated by halves, separate LayerNorms and biases
everywhere; greedy sampling through the sampler's programs. Tolerances as in test_numerics."""
import dataclasses

import jax
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer import sampler as sampling
from tests.device.model import trained_scale_params
from tests.device.test_numerics import BATCH, DTYPES, assert_close, compare, infer_layout, on_both, train_layout

NEOX = {"family": "gptneox", "layers": 4, "d_model": 256, "n_heads": 8, "n_vocab": 1024, "pe_rotary_dims": 8,
        "rotary_base": 10000.0, "seq": 64, "cores_per_replica": 1, "remat": False}


def neox(parallel: bool, dtype: str = "float32") -> config.Config:
    return config.from_dict({**NEOX, "parallel_residual": parallel, "compute_dtype": dtype})


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "sequential"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gptneox_forward_logits_on_the_chip_equal_the_cpus(chip, host, dtype, parallel):
    cfg = neox(parallel, dtype)
    params = trained_scale_params(cfg, seed=4)
    tokens_BxT = np.random.default_rng(5).integers(0, cfg.n_vocab, (BATCH, cfg.seq)).astype(np.int32)

    def logits(cfg, device):
        layout = train_layout(cfg, device)
        return layout.logits_fn()(jax.device_put(params, layout.param_shardings()), tokens_BxT)

    compare(dtype, *(x.reshape(-1, cfg.n_vocab) for x in on_both(logits, cfg, chip, host)))


def test_gptneox_greedy_sampling_on_the_chip_makes_the_cpus_tokens(chip, host):
    """Prefill, then the decode loop on the device, in f32: the same greedy tokens, log-probs within 1e-4."""
    cfg = neox(True)
    params = trained_scale_params(cfg, seed=6)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, cfg.n_vocab, n).tolist() for n in (16, 3, 9, 1)]

    def greedy(device):
        results = sampling.Sampler(infer_layout(dataclasses.replace(cfg), device), params).generate(
            prompts, 24, temperature=0.0, stop_token_ids=[], return_logprobs=True)
        return [r.tokens for r in results], np.array([r.logprobs for r in results])

    with jax.default_matmul_precision("highest"):
        (chip_tokens, chip_logprobs), (host_tokens, host_logprobs) = (greedy(d) for d in (chip, host))
    assert chip_tokens == host_tokens
    assert_close(chip_logprobs, host_logprobs)
