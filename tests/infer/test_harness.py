"""The lm-eval adapter against lm-eval's own `hf` model on the same weights exported to HF, on test-written tasks."""
import jax
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer import harness
from mesh_transformer.infer.params import make_inference_layout, read_params
from mesh_transformer.model import gptj as model
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import TASKS, write_hf_dir, write_tasks

CFG = config.from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 50304, "pe_rotary_dims": 4, "seq": 64,
                        "cores_per_replica": 4, "remat": False})


def random_params(cfg, seed=0):
    """Random weights made with numpy (nothing to compile), large enough that the argmax is rarely a near-tie."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(shape.shape, np.float32)
        return (rng.standard_normal(shape.shape) * (0.05 if "bias" in name else 0.2)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, model.param_shapes(cfg))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf_dir(str(tmp_path_factory.mktemp("hf")), random_params(CFG), CFG)


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    return write_tasks(str(tmp_path_factory.mktemp("tasks")))


def native(hf_dir, dp, mp):
    layout = make_inference_layout(CFG, mesh=make_dp_mp(dp, mp))
    return harness.MeshTransformerLM(layout, read_params(layout, hf_dir), load_tokenizer(), batch_size=4)


def run(lm, tasks_dir):
    return harness.evaluate(lm, list(TASKS), include_path=tasks_dir, log_samples=True, bootstrap_iters=0)


@pytest.fixture(scope="module")
def hf_results(hf_dir, tasks_dir):
    """lm-eval's own HF model on the export: the reference."""
    return harness.evaluate("hf", list(TASKS), include_path=tasks_dir, log_samples=True, bootstrap_iters=0,
                            model_args=f"pretrained={hf_dir},dtype=float32", device="cpu", batch_size=4)


def per_sample(results):
    """task -> [(doc_id, filtered response)] in doc order."""
    return {task: [(s["doc_id"], s["filtered_resps"]) for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in results["samples"].items()}


def assert_same(ours, ref):
    a, b = per_sample(ours), per_sample(ref)
    for task in TASKS:
        for (doc_a, resp_a), (doc_b, resp_b) in zip(a[task], b[task], strict=True):
            assert doc_a == doc_b
            if task == "tiny_gen":
                assert resp_a == resp_b
            elif task == "tiny_mc":
                np.testing.assert_allclose([r[0] for r in resp_a], [r[0] for r in resp_b], atol=1e-4, rtol=0)
                assert [r[1] for r in resp_a] == [r[1] for r in resp_b]
            else:
                np.testing.assert_allclose(resp_a, resp_b, atol=1e-4, rtol=0)
    for task in TASKS:
        metrics = {k: v for k, v in ours["results"][task].items() if k.startswith(("acc", "exact_match"))}
        assert metrics == {k: ref["results"][task][k] for k in metrics}, task


def test_adapter_matches_hf_model_on_dp_mp_mesh(hf_dir, tasks_dir, hf_results):
    assert_same(run(native(hf_dir, 2, 4), tasks_dir), hf_results)
