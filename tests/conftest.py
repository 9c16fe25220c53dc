"""Test set-up: 8 faked CPU devices, set before jax is imported anywhere; HF offline; the evaluation tests'
session fixtures."""
import os

import pytest

# LLVM's optimization level 0 for XLA's CPU code: the tests compile hundreds of tiny programs and run each a few
# times, so compiling is most of their time (tests/model: 167 s at the default level, 114 s at 0). The programs,
# buffers and float semantics are XLA's own either way; child processes inherit the flags.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing is downloaded at test time: HF's libraries fail at once instead of waiting on the network (a test that
# looked for a missing dataset waited 23 s for connection timeouts). Read when they are first imported.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def eval_hf_dir(tmp_path_factory):
    """The tiny random model of the evaluation tests, exported to HF (tests/infer/test_harness.py's EVAL_CFG)."""
    from tests.helpers import EVAL_CFG, random_eval_params, write_hf_dir

    return write_hf_dir(str(tmp_path_factory.mktemp("eval_hf")), random_eval_params(), EVAL_CFG)


@pytest.fixture(scope="session")
def eval_tasks(tmp_path_factory):
    """(include_path, TaskManager) of the test-written lm-eval tasks."""
    from mesh_transformer.infer import harness
    from tests.helpers import TASKS, write_tasks

    tasks_dir = write_tasks(str(tmp_path_factory.mktemp("eval_tasks")))
    return tasks_dir, harness.task_manager(tasks_dir, TASKS)


@pytest.fixture(scope="session")
def hf_eval_results(eval_hf_dir, eval_tasks):
    """lm-eval's own `hf` model on the export, on the test tasks: the reference the other backends must match."""
    from mesh_transformer.infer import harness
    from tests.helpers import EVAL_OPTIONS, TASKS

    return harness.evaluate("hf", TASKS, manager=eval_tasks[1], **EVAL_OPTIONS, device="cpu",
                            model_args=f"pretrained={eval_hf_dir},dtype=float32")
