"""What a training step trains and what it holds frozen, as two trees from the start of the step.

A full fine-tune trains the params and freezes nothing; LoRA trains the adapters (model/lora.py) and holds the base
params frozen: read, never differentiated, never donated. Everything that differs between the two is here, chosen
once (`split_of`): the trees' logical axes and init, and how the model is called on them. A Layout places both trees
by their axes and differentiates the loss w.r.t. the trainable one; the train state holds the trainable one.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from mesh_transformer.config import Config
from mesh_transformer.model import lora, table


@dataclasses.dataclass(frozen=True)
class Split:
    """One way of splitting the model's trees into trainable and frozen."""
    name: str
    trainable_axes: Callable[[Config], Any]  # cfg -> a tree of logical axes
    frozen_axes: Callable[[Config], Any]
    init: Callable[[Config, jax.Array], Any]  # (cfg, key) -> fresh trainable tree (global arrays)
    model: Callable[[Any, Any], tuple[dict, dict | None]]  # (trainable, frozen) -> (params, adapters or None)
    trained_layers: Callable[[Any], Any]  # the trainable tree's stacked-layer part (gradient accumulation)
    trained_in_layer: int  # which of a layer's (params, adapters) is trained

    def with_trained_layers(self, trainable: Any, layers: Any) -> Any:
        """The trainable tree with its stacked-layer part replaced."""
        return layers if self.trained_in_layer == 1 else {**trainable, "layers": layers}


FULL = Split("full", trainable_axes=table.param_axes, frozen_axes=lambda cfg: {},
             init=table.init_params, model=lambda trainable, frozen: (trainable, None),
             trained_layers=lambda trainable: trainable["layers"], trained_in_layer=0)
LORA = Split("lora", trainable_axes=lora.lora_axes, frozen_axes=lora.base_axes,
             init=lora.init_lora, model=lambda trainable, frozen: (frozen, trainable),
             trained_layers=lambda trainable: trainable, trained_in_layer=1)


def split_of(cfg: Config) -> Split:
    """LoRA where cfg.lora_rank > 0, else a full fine-tune."""
    return LORA if cfg.lora_rank else FULL
