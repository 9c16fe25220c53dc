"""LoRA adapters in the model: init, step 0 equals the base, merged weights equal the adapted model."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mesh_transformer.model import table
from mesh_transformer import config
from mesh_transformer.model import gptj as model
from mesh_transformer.model import lora
from tests.helpers import CPU_POLICY

CFG = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false", "lora_rank=4",
                                                    "lora_alpha=8"])


def random_adapters(cfg, seed=0):
    """Adapters with B nonzero too, so that the low-rank path counts."""
    adapters = lora.init_lora(cfg, jax.random.PRNGKey(seed))
    keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), len(adapters)))
    return {t: {"a": ab["a"], "b": 0.1 * jax.random.normal(next(keys), ab["b"].shape)} for t, ab in adapters.items()}


def test_init_is_normal_a_and_zero_b_stacked_over_layers():
    adapters = lora.init_lora(dataclasses.replace(CFG, lora_rank=64), jax.random.PRNGKey(0))
    assert set(adapters) == set(config.LORA_TARGETS) - {"gate"}  # every target but a gated MLP's
    d, f = CFG.d_model, CFG.d_ff
    assert adapters["q"]["a"].shape == (CFG.layers, d, 64) and adapters["q"]["b"].shape == (CFG.layers, 64, d)
    assert adapters["fc_out"]["a"].shape == (CFG.layers, f, 64) and adapters["fc_out"]["b"].shape == (CFG.layers, 64, d)
    np.testing.assert_allclose(float(adapters["fc_out"]["a"].std()), 1 / np.sqrt(f), rtol=0.05)
    assert all(not np.asarray(ab["b"]).any() for ab in adapters.values())
    assert lora.scale(CFG) == 2.0 and lora.scale(dataclasses.replace(CFG, lora_alpha=None)) == 1.0


def test_step_zero_equals_the_base_model():
    base = table.init_unsharded(CFG, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, CFG.seq), 0, CFG.n_vocab)
    adapters = lora.init_lora(CFG, jax.random.PRNGKey(2))
    adapted = model.forward(base, ids, CFG, policy=CPU_POLICY, adapters=adapters)
    np.testing.assert_array_equal(adapted, model.forward(base, ids, CFG, policy=CPU_POLICY))


def test_merged_logits_equal_adapted_logits():
    base = table.init_unsharded(CFG, jax.random.PRNGKey(0))
    adapters = random_adapters(CFG)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, CFG.seq), 0, CFG.n_vocab)
    forward = jax.jit(lambda p, x, a=None: model.forward(p, x, CFG, policy=CPU_POLICY, adapters=a))
    adapted = forward(base, ids, adapters)
    assert float(jnp.abs(adapted - forward(base, ids)).max()) > 1e-2  # the adapters do change the model
    np.testing.assert_allclose(adapted, forward(lora.merge(base, adapters, lora.scale(CFG)), ids), atol=1e-5, rtol=0)


def test_only_the_named_targets_are_adapted():
    cfg = dataclasses.replace(CFG, lora_targets=["v", "fc_in"])
    assert set(lora.init_lora(cfg, jax.random.PRNGKey(0))) == {"v", "fc_in"}
    layer = jax.tree.map(lambda s: jnp.zeros(s.shape[1:]), table.param_shapes(cfg)["layers"])
    adapters = jax.tree.map(lambda x: x[0], lora.init_lora(cfg, jax.random.PRNGKey(0)))
    adapted = lora.adapt_layer(layer, adapters, lora.scale(cfg))
    assert isinstance(adapted["attn"]["v"], lora.Adapted)
    assert isinstance(adapted["mlp"]["fc_in"]["kernel"], lora.Adapted)
    assert not isinstance(adapted["attn"]["q"], lora.Adapted) and lora.adapt_layer(layer, None, 1.0) is layer
