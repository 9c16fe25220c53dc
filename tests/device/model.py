"""The device tier's model: a config small enough to compile quickly, wide and deep enough that bf16's rounding has
something to accumulate over, and random weights at a trained model's scale."""
import numpy as np

from mesh_transformer import config
from mesh_transformer.model import table

CFG = config.from_dict({"layers": 4, "d_model": 256, "n_heads": 8, "n_vocab": 1024, "pe_rotary_dims": 16, "seq": 64,
                        "cores_per_replica": 1, "remat": False})


def trained_scale_params(cfg: config.Config = CFG, seed: int = 0) -> dict:
    """Random f32 params at the scale of a trained model's, so the logits spread (std about 1) and the most likely
    token is well defined (the original's init at std 0.02 gives near-flat logits): matrices N(0, 1/fan_in), so
    activations keep their size layer after layer; embedding N(0, 1); LayerNorm scales 1 + N(0, 0.1^2); biases
    N(0, 0.1^2), so every leaf counts."""
    rng = np.random.default_rng(seed)
    params: dict = {}
    for path, shape in table.param_paths(cfg):
        init = table.params_table(cfg)[path].init
        if init == "ones":
            value = 1 + 0.1 * rng.standard_normal(shape.shape)
        elif init == "zeros":
            value = 0.1 * rng.standard_normal(shape.shape)
        elif init == "vocab":
            value = rng.standard_normal(shape.shape)
        else:
            value = rng.standard_normal(shape.shape) / np.sqrt(shape.shape[-2])
        table.set_path(params, path, value.astype(np.float32))
    return params
