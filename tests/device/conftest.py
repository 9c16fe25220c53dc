"""The device tier: the chip against the CPU on the same weights, and every script end to end on the chip.

Collected only with MTJ_TEST_TIER=device where a TPU or GPU is attached (`make test-device`, in one process: one
program at a time can hold a chip). Anywhere else this folder contributes no test: `make test` on a CPU machine
collects nothing from it, and `pytest tests/device` there exits 0. With MTJ_TEST_TIER=device on a machine without an
accelerator the run exits 5, "no tests ran", and says why, rather than passing green with nothing run.

Whether an accelerator is attached is asked without starting JAX (`platforms.expected_platform`, the package's own
answer): once this process opens the chip, no other process can until this one exits, and the script tests start the
scripts on the chip in child processes. So those run first (`pytest_collection_modifyitems`), and the `chip` fixture,
which opens it here, checks that JAX did find the accelerator.

Escape hatch, to keep the tier from rotting where there is no chip: MTJ_DEVICE_TIER_ON_CPU=1 collects it on a CPU
machine too, the "accelerator" then being the CPU backend's first device (so each comparison is the CPU against
itself, and only shows that the tests' Python and flows work):

    MTJ_TEST_TIER=device MTJ_DEVICE_TIER_ON_CPU=1 JAX_PLATFORMS=cpu .venv/bin/python -m pytest -q tests/device -x
"""
import os
from pathlib import Path

import pytest

TIER_ON = os.environ.get("MTJ_TEST_TIER") == "device"
ON_CPU = os.environ.get("MTJ_DEVICE_TIER_ON_CPU") == "1"
HERE = Path(__file__).parent


def _not_collected_because() -> str | None:
    """Why the tier is not collected here, or None where it is."""
    if not TIER_ON:
        return "MTJ_TEST_TIER is not 'device'"
    from mesh_transformer import platforms

    if platforms.expected_platform() == platforms.CPU and not ON_CPU:
        return "no TPU or GPU is attached (MTJ_DEVICE_TIER_ON_CPU=1 runs the tier on the CPU)"
    return None


NOT_COLLECTED_BECAUSE = _not_collected_because()
collect_ignore_glob = ["*"] if NOT_COLLECTED_BECAUSE else []


def pytest_terminal_summary(terminalreporter):
    if NOT_COLLECTED_BECAUSE and TIER_ON:
        terminalreporter.write_line(f"device tier not collected: {NOT_COLLECTED_BECAUSE}")


def pytest_sessionfinish(session, exitstatus):
    # `pytest tests/device` without the tier is a run with nothing to do, not a failure.
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and not TIER_ON:
        session.exitstatus = pytest.ExitCode.OK


def pytest_collection_modifyitems(items):
    """The tier's tests that run the chip in this process (those using the `chip` fixture) after those that run it
    in child processes; the rest of a session's tests keep their places."""
    places = [i for i, item in enumerate(items) if HERE in item.path.parents]
    ordered = sorted((items[i] for i in places), key=lambda item: "chip" in item.fixturenames)
    for i, item in zip(places, ordered):
        items[i] = item


@pytest.fixture(scope="session")
def chip():
    """The accelerator the tier runs on, opened in this process: JAX's first device (the CPU's first under
    MTJ_DEVICE_TIER_ON_CPU)."""
    import jax

    device = jax.devices()[0]
    assert device.platform != "cpu" or ON_CPU, "an accelerator is attached, but JAX started on the CPU"
    return device


@pytest.fixture(scope="session")
def host(chip):
    """The CPU device the chip is compared against."""
    import jax

    return jax.devices("cpu")[0]


@pytest.fixture
def highest_precision():
    """f32 products at full precision in every thread: the serving engine runs its programs on a thread of its own,
    which a `with jax.default_matmul_precision(...)` block of this one does not reach."""
    import jax

    before = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")
    yield
    jax.config.update("jax_default_matmul_precision", before)
