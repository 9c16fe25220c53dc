"""LoRA adapters served side by side (model/lora_slots.py, infer/adapter_slots.py): a batch mixing the base and three
adapters of different ranks and targets, each row in its own slot, gives each row the greedy tokens and log-probs of
its merged model, through the slot and paged caches' programs, on one device and on dp 2 x mp 4."""
import dataclasses

import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.infer import adapter_slots, decode
from mesh_transformer.infer import params as infer_params
from mesh_transformer.infer.choose import fill_sampling
from mesh_transformer.infer.programs import Programs
from mesh_transformer.infer.sampler import Sampler
from mesh_transformer.model import lora, lora_slots
from mesh_transformer.parallel.mesh import make_dp_mp
from tests.helpers import random_params, served_greedy

BASE = config.load("configs/tiny_rot_partial.json", ["cores_per_replica=1", "remat=false"])  # seq 32, vocab 256
SERVED = dataclasses.replace(BASE, max_loras=4, max_lora_rank=8)
PROMPTS = [[5, 17, 42, 9, 1], [100, 3, 7, 9, 250, 11, 2, 8], [1, 2, 3], [9, 9, 4, 200, 3, 3]]
# (rank, targets, alpha) of the three adapters; row r of a batch runs ROW_SLOTS[r] (-1: the base)
ADAPTERS = [(2, ("q", "k", "v", "out", "fc_in", "fc_out"), 4.0), (4, ("q", "v"), 8.0),
            (8, ("out", "fc_in", "fc_out"), 8.0)]
SLOTS = [2, 0, 3]  # the slot each adapter is written into
ROW_SLOTS = np.array([-1, 2, 0, 3], np.int32)
STEPS = 5


def random_adapter(rank: int, targets: tuple, seed: int, base=BASE) -> dict:
    cfg = dataclasses.replace(base, lora_rank=rank, lora_targets=list(targets))
    rng = np.random.default_rng(seed)
    return {t: {w: (rng.normal(size=s.shape) * 0.3).astype(np.float32) for w, s in ab.items()}
            for t, ab in lora.lora_shapes(cfg).items()}


def make_models(base_cfg=BASE) -> tuple[dict, list]:
    """The base params, and each adapter with its scale."""
    adapters = [(random_adapter(rank, targets, 10 + i, base_cfg), alpha / rank) for i, (rank, targets, alpha) in
                enumerate(ADAPTERS)]
    return random_params(base_cfg, 0), adapters


@pytest.fixture(scope="module")
def models():
    return make_models()


def merged_greedy(base: dict, adapters: list, base_cfg=BASE) -> tuple[list, list]:
    """Each row's greedy tokens and log-probs from its own merged model (the base for a row of none)."""
    layout = infer_params.make_inference_layout(base_cfg, mesh=make_dp_mp(1, 1))
    models = {-1: base, **{slot: lora.merge(base, ab, scale) for slot, (ab, scale) in zip(SLOTS, adapters)}}
    tokens, logprobs = [], []
    for prompt, slot in zip(PROMPTS, ROW_SLOTS):
        result = Sampler(layout, infer_params.place_params(models[int(slot)], layout)).generate(
            [prompt], STEPS + 1, temperature=0.0, return_logprobs=True, stop_token_ids=[])[0]
        tokens.append(list(result.tokens))
        logprobs.append(list(result.logprobs))
    return tokens, logprobs


def served_params(base: dict, adapters: list, layout) -> dict:
    params = adapter_slots.with_slots(infer_params.place_params(base, layout), layout)
    writer = adapter_slots.SlotWriter(layout)
    for slot, (ab, scale) in zip(SLOTS, adapters):
        params = writer.write(params, slot, ab, scale)
    return params


def padded(prompts, width):
    ids = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return ids, np.array([len(p) for p in prompts], np.int32)


def run_paged(layout, params):
    """Greedy tokens and chosen log-probs [rows, 1 + STEPS] through the paged programs, one prompt a slot."""
    return served_greedy(layout, params, PROMPTS, ROW_SLOTS, STEPS)


def run_slot_cache(layout, params):
    """The same through the slot cache's programs (prefill, decode)."""
    programs, n = Programs(layout), len(PROMPTS)
    cache, slots = programs.new_cache(n, [SERVED.seq]), programs.new_slots(n)
    ids, length = padded(PROMPTS, 12)
    sampling = fill_sampling(n, [])._replace(adapter=ROW_SLOTS, logprobs=np.ones(n, bool))
    token, chosen, slots, cache = programs.prefill(params, cache, slots, ids, length, np.arange(n, dtype=np.int32),
                                                   sampling)
    steps = decode.Steps(length.copy(), np.ones(n, np.int32), sampling)
    tokens, logprobs = [np.asarray(token)], [np.asarray(chosen.chosen)]
    for _ in range(STEPS):
        token, chosen, slots, steps, cache = programs.decode(params, cache, slots, steps, rows=n, n_blocks=1)
        tokens.append(np.asarray(token))
        logprobs.append(np.asarray(chosen.chosen))
    return np.stack(tokens, 1), np.stack(logprobs, 1)


@pytest.mark.parametrize("mesh", [(1, 1), (2, 4)], ids=["one-device", "dp2-mp4"])
def test_a_batch_mixing_adapters_gives_each_row_its_merged_models_greedy_output(models, mesh):
    base, adapters = models
    want_tokens, want_logprobs = merged_greedy(base, adapters)
    layout = infer_params.make_inference_layout(SERVED, mesh=make_dp_mp(*mesh))
    params = served_params(base, adapters, layout)
    runs = [run_paged(layout, params)] + ([run_slot_cache(layout, params)] if mesh == (1, 1) else [])
    for tokens, logprobs in runs:
        np.testing.assert_array_equal(tokens, np.array(want_tokens))
        np.testing.assert_allclose(logprobs, np.array(want_logprobs), rtol=0, atol=1e-4)


def test_gpt_neox_adapters_mixed_in_one_batch_give_their_merged_models_greedy_output():
    # GPT-NeoX: the MLP reads its own LayerNorm (`Projections.inputs` of two inputs), biases on q, k, v and out.
    neox = config.load("configs/tiny_neox.json", ["cores_per_replica=1", "remat=false"])
    base, adapters = make_models(neox)
    want_tokens, want_logprobs = merged_greedy(base, adapters, neox)
    layout = infer_params.make_inference_layout(dataclasses.replace(neox, max_loras=4, max_lora_rank=8),
                                                mesh=make_dp_mp(1, 1))
    tokens, logprobs = run_paged(layout, served_params(base, adapters, layout))
    np.testing.assert_array_equal(tokens, np.array(want_tokens))
    np.testing.assert_allclose(logprobs, np.array(want_logprobs), rtol=0, atol=1e-4)


def test_an_adapter_changes_its_rows_alone_and_a_cleared_slot_serves_the_base(models):
    base, adapters = models
    layout = infer_params.make_inference_layout(SERVED, mesh=make_dp_mp(1, 1))
    params = served_params(base, adapters, layout)
    with_adapters = run_paged(layout, params)[1]
    writer = adapter_slots.SlotWriter(layout)
    for slot in SLOTS:
        params = writer.clear(params, slot)
    cleared = run_paged(layout, params)
    plain = run_paged(layout, adapter_slots.with_slots(infer_params.place_params(base, layout), layout))
    np.testing.assert_array_equal(cleared[0], plain[0])
    np.testing.assert_array_equal(cleared[1], plain[1])
    # The base's row is the base's; each adapter moves its own row's log-probs.
    np.testing.assert_array_equal(with_adapters[0], plain[1][0])
    assert all(np.abs(with_adapters[r] - plain[1][r]).max() > 1e-2 for r in (1, 2, 3))


def test_an_adapter_over_the_served_rank_is_refused(models):
    layout = infer_params.make_inference_layout(dataclasses.replace(SERVED, max_lora_rank=4), mesh=make_dp_mp(1, 1))
    params = adapter_slots.with_slots(infer_params.place_params(models[0], layout), layout)
    with pytest.raises(ConfigError, match="rank 8 is over the served maximum 4"):
        adapter_slots.SlotWriter(layout).write(params, 0, *models[1][2])


@pytest.mark.parametrize("rows", [3, 9])
def test_gathering_each_rows_adapter_and_reading_every_slot_give_the_same_products(rows):
    """`lora_slots._delta`'s two forms (the CPU's gather, and every slot once where the rows outnumber the slots)."""
    rng = np.random.default_rng(0)
    ab = {"a": rng.normal(size=(4, 16, 8)).astype(np.float32), "b": rng.normal(size=(4, 8, 24)).astype(np.float32)}
    x = rng.normal(size=(rows, 5, 16)).astype(np.float32)
    adapter = rng.integers(-1, 4, rows).astype(np.int32)
    want = np.stack([np.zeros((5, 24)) if s < 0 else x[r] @ ab["a"][s] @ ab["b"][s] for r, s in enumerate(adapter)])
    for gather in (True, False):
        np.testing.assert_allclose(lora_slots._delta(x, ab, adapter, gather), want, rtol=1e-5, atol=1e-5)


def test_adapters_beside_int8_weights_leave_the_base_rows_as_the_int8_model_has_them(models):
    """int8 weights (the adapters in the compute dtype beside them): the base's row is the int8 model's own, and each
    adapter moves its row."""
    base, adapters = models
    int8 = config.from_dict({**SERVED.to_dict(), **config.INFERENCE_DTYPES["int8"]})
    layout = infer_params.make_inference_layout(int8, mesh=make_dp_mp(1, 1))
    plain = infer_params.make_inference_layout(dataclasses.replace(int8, max_loras=0), mesh=make_dp_mp(1, 1))
    tokens, logprobs = run_paged(layout, served_params(base, adapters, layout))
    alone = Sampler(plain, infer_params.place_params(base, plain)).generate(
        [PROMPTS[0]], STEPS + 1, temperature=0.0, return_logprobs=True, stop_token_ids=[])[0]
    assert list(tokens[0]) == list(alone.tokens)
    np.testing.assert_allclose(logprobs[0], alone.logprobs, rtol=0, atol=1e-3)
    cleared = run_paged(layout, adapter_slots.with_slots(infer_params.place_params(base, layout), layout))[1]
    assert all(np.abs(logprobs[r] - cleared[r]).max() > 1e-2 for r in (1, 2, 3))
