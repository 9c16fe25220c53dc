"""Joining a multi-process run only where the environment describes one, and a training mesh fitted to the devices
present."""
import jax
import pytest

from mesh_transformer import config
from mesh_transformer.config import ConfigError
from mesh_transformer.parallel import mesh
from mesh_transformer.parallel.layout import make_layout

HINT_VARS = (*mesh._PROCESS_COUNT_VARS, *mesh._TPU_WORKER_VARS)


@pytest.fixture
def no_cluster(monkeypatch):
    """An environment that names no cluster, with jax.distributed.initialize recording its calls."""
    for var in HINT_VARS:
        monkeypatch.delenv(var, raising=False)
    calls = []

    def initialize(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Failed to resolve 'metadata.google.internal'")  # a TPU host without metadata

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    return calls


def test_a_single_process_never_calls_jax_distributed(no_cluster):
    mesh.init_distributed()
    assert no_cluster == []


def test_a_tpu_host_that_cannot_reach_its_metadata_is_a_single_process(no_cluster, monkeypatch):
    from mesh_transformer import platforms

    monkeypatch.setattr(platforms, "expected_platform", lambda: platforms.TPU)
    monkeypatch.setattr(mesh, "TPU_METADATA_URL", "http://127.0.0.1:9/worker-network-endpoints")  # refused at once
    assert mesh.cluster_hint() is None
    mesh.init_distributed()
    assert no_cluster == []


@pytest.mark.parametrize("var, value, count", [("OMPI_COMM_WORLD_SIZE", "4", 4), ("SLURM_NTASKS", "2", 2),
                                               ("TPU_WORKER_HOSTNAMES", "host-a,host-b", 2)])
def test_a_launcher_that_says_several_processes_is_joined_or_named_in_a_one_line_error(no_cluster, monkeypatch, var,
                                                                                       value, count):
    monkeypatch.setenv(var, value)
    assert mesh.cluster_hint() == (count, var)
    with pytest.raises(ConfigError, match=rf"{var} says this run has {count} processes, but joining them failed "
                                          r"\(Failed to resolve .*\); give --coordinator HOST:PORT") as err:
        mesh.init_distributed()
    assert "\n" not in str(err.value) and len(no_cluster) == 1


def test_a_launcher_of_one_process_is_a_single_process(no_cluster, monkeypatch):
    monkeypatch.setenv("SLURM_NTASKS", "1")
    mesh.init_distributed()
    assert no_cluster == []


def test_training_fits_the_model_parallel_width_to_the_devices_present():
    cfg = config.load("configs/demo.json")  # cores_per_replica 4
    assert config.fit_devices(cfg, 8) == cfg
    assert config.fit_devices(cfg, 1).cores_per_replica == 1
    assert config.fit_devices(cfg, 6).cores_per_replica == 2  # 4 does not divide 6; 2 is the widest that does
    layout = make_layout(cfg, devices=jax.devices()[:1])
    assert dict(layout.mesh.shape) == {"dp": 1, "mp": 1} and layout.cfg.cores_per_replica == 1
    gspmd = config.from_dict({**cfg.to_dict(), "parallelism": "fsdp", "mesh_fsdp": 4})
    with pytest.raises(ConfigError, match=r"'mesh_fsdp' x 'mesh_tensor' \(4 x 1\) must divide the device count \(6\)"):
        config.fit_devices(gspmd, 6)
