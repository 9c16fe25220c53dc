import dataclasses

import jax
import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.store import hf
from mesh_transformer.model import gptj as model
from tests.helpers import CPU_POLICY, random_hf_model, state_dict_numpy

TINY = {
    "rotary-partial": config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1"]),
    "rotary-full": config.load("configs/tiny_rot_full.json", ["cores_per_replica=1"]),
    # 256 ids, the tokenizer's first 200 used: the padding rows exist but are never fed.
    "vocab-padded": config.from_dict({"layers": 2, "d_model": 48, "n_heads": 4, "n_vocab": 256,
                                      "pe_rotary_dims": 6, "seq": 24, "cores_per_replica": 1}),
}


@pytest.mark.parametrize("name", list(TINY))
def test_logits_equal_hf_gptj(name):
    cfg = TINY[name]
    hf_model = random_hf_model(cfg)
    params = hf.hf_to_params(state_dict_numpy(hf_model), cfg)
    vocab_used = 200 if name == "vocab-padded" else cfg.n_vocab
    ids = np.random.default_rng(0).integers(0, vocab_used, (2, cfg.seq))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda p, x: model.forward(p, x, cfg, policy=CPU_POLICY))(params, ids))
    np.testing.assert_allclose(ours, expected, atol=1e-4, rtol=0)


def test_hf_round_trip_is_exact():
    cfg = TINY["rotary-partial"]
    params = jax.tree.map(np.asarray, table.init_unsharded(cfg, jax.random.PRNGKey(3)))
    state = hf.params_to_hf(params, cfg)
    assert set(state) == set(hf.hf_names(cfg))
    back = hf.hf_to_params(state, cfg)
    jax.tree.map(np.testing.assert_array_equal, back, params)
    # and HF itself accepts the state dict as complete
    hf_model = GPTJForCausalLM(GPTJConfig(**hf.hf_config(cfg)))
    torch_state = {k: torch.from_numpy(v.copy()) for k, v in state.items()}
    missing, unexpected = hf_model.load_state_dict(torch_state, strict=False)
    assert not unexpected and all(".attn.bias" in m or "masked_bias" in m for m in missing)


def test_config_from_hf_matches():
    cfg = TINY["rotary-full"]
    assert config.from_dict({**cfg.to_dict()}) == dataclasses.replace(
        hf.config_from_hf(hf.hf_config(cfg), cores_per_replica=1), **{
            k: v for k, v in cfg.to_dict().items() if k not in ("layers", "d_model", "n_heads", "n_vocab",
                                                                  "pe_rotary_dims", "seq")})


def test_hf_checkpoint_missing_weight_or_wrong_shape_is_clear():
    cfg = TINY["rotary-full"]
    state = state_dict_numpy(random_hf_model(cfg))
    del state["transformer.h.1.mlp.fc_in.bias"]
    with pytest.raises(ValueError, match="lacks weight 'transformer.h.1.mlp.fc_in.bias'"):
        hf.hf_to_params(state, cfg)
    state = state_dict_numpy(random_hf_model(cfg))
    with pytest.raises(ValueError, match="transformer.wte.weight has shape"):
        hf.hf_to_params(state, dataclasses.replace(cfg, n_vocab=64))
