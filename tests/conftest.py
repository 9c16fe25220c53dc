"""Test set-up: 8 faked CPU devices, set before jax is imported anywhere; HF offline; the evaluation tests'
session fixtures. With MTJ_TEST_TIER=device (`make test-device`, tests/device) JAX is left to find the accelerator."""
import os
import shutil
import tempfile

import pytest

# The device tier (tests/device, `make test-device`) runs where JAX finds a TPU or GPU: with MTJ_TEST_TIER=device
# JAX is not pinned to the CPU. The CPU backend, which that tier compares against, keeps its 8 faked devices (the flag
# affects the CPU backend alone).
DEVICE_TIER = os.environ.get("MTJ_TEST_TIER") == "device"
if not DEVICE_TIER:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# LLVM's optimization level 0 for XLA's CPU code: the tests compile hundreds of tiny programs and run each a few
# times, so compiling is most of their time (tests/model: 167 s at the default level, 114 s at 0). The programs,
# buffers and float semantics are XLA's own either way; child processes inherit the flags. Only where JAX is pinned
# to the CPU: the flag reaches every backend's compiler, and the device tier tests the programs users run.
_FLAGS = ("--xla_force_host_platform_device_count=8",)
if os.environ.get("JAX_PLATFORMS") == "cpu":
    _FLAGS += ("--xla_backend_optimization_level=0",)
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags, *(f for f in _FLAGS if f not in _flags)]).strip()
# Implicit rank promotion (a [B, T] array added to a [B, T, V] one) is an error in the tests, here and in the scripts
# they start: silent broadcasting hides shape mistakes.
os.environ["JAX_NUMPY_RANK_PROMOTION"] = "raise"
# JAX's persistent compilation cache, fresh for each run and shared with the scripts the tests start: many tests
# compile the same tiny programs (tests/train: 237 s without, 183 s with, starting empty). The cache key holds the
# program, the flags and the compile options, so a hit is the program a compile would have made. pytest-xdist's
# workers inherit the directory from the process that made it, which removes it at the end.
_OWN_CACHE = "MTJ_TEST_COMPILE_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["MTJ_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="mtj-test-compile-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["MTJ_TEST_COMPILE_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Nothing is downloaded at test time: HF's libraries fail at once instead of waiting on the network (a test that
# looked for a missing dataset waited 23 s for connection timeouts). Read when they are first imported.
os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def started_jax():
    """JAX started with the 8 faked devices before any test runs: a tool that sets the CPU device count when JAX
    has not started (aot's --devices N) must find it started, or the rest of the process would have N devices.
    Not in the device tier: there the scripts run on the chip in child processes first, and a process that has
    opened the chip holds it until it exits (tests/device/conftest.py)."""
    if DEVICE_TIER:
        return None
    import jax

    return jax.devices()


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(scope="session")
def eval_hf_dir(tmp_path_factory):
    """The tiny random model of the evaluation tests, exported to HF (tests/helpers.py's EVAL_CFG)."""
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
