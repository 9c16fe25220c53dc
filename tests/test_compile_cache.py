"""The command-line tools' persistent compilation cache (mesh_transformer/compile_cache.py): where it lives, that a
second run reads the programs the first one wrote, and that several runs can share it."""
import concurrent.futures
import os
import re

import numpy as np
import pytest

from mesh_transformer import compile_cache
from mesh_transformer.store import checkpoint
from tests.helpers import make_config, random_params, run_script, save_config


def test_the_flag_then_the_environment_then_jax_then_xdg_choose_the_directory(monkeypatch, tmp_path):
    for name in (compile_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache.chosen_dir(None) == str(tmp_path / ".cache" / "mesh-transformer" / "jax")
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert compile_cache.chosen_dir(None) == "/xdg/mesh-transformer/jax"
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/jax")
    assert compile_cache.chosen_dir(None) == "/jax"
    monkeypatch.setenv(compile_cache.ENV, "off")
    assert compile_cache.chosen_dir(None) is None
    assert compile_cache.chosen_dir("gs://bucket/cache") == "gs://bucket/cache"
    assert compile_cache.chosen_dir("off") is None


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("cached")
    cfg = make_config(tmp_path, layers=2, d_model=32, n_heads=4, n_vocab=50304, seq=64, cores_per_replica=1,
                      model_dir=str(tmp_path / "ckpt"))
    checkpoint.save(cfg.model_dir, 1, {"step": np.int32(1), "params": random_params(cfg, 0)}, blocking=True)
    return save_config(tmp_path, cfg)


def _sample(config_path: str, *flags: str):
    return run_script("device_sample.py", "--config", config_path, "--prompt", "Hello world", "--max-new-tokens", "8",
                      "--temperature", "0", *flags)


def _read_from_cache(stderr: str) -> tuple[int, int]:
    found = re.search(r"compilation cache .*: (\d+) of (\d+) programs read from it", stderr)
    assert found, stderr
    return int(found.group(1)), int(found.group(2))


def test_a_second_run_reads_every_program_the_first_compiled(tiny_config, tmp_path):
    cache = str(tmp_path / "cache")
    first = _sample(tiny_config, "--compilation-cache", cache)
    assert first.returncode == 0, first.stderr
    assert _read_from_cache(first.stderr)[0] == 0 and os.listdir(cache)
    second = _sample(tiny_config, "--compilation-cache", cache)
    assert second.returncode == 0, second.stderr
    hits, requests = _read_from_cache(second.stderr)
    assert hits == requests > 0 and second.stdout == first.stdout


def test_runs_sharing_a_cache_at_once_all_complete_alike(tiny_config, tmp_path):
    cache = str(tmp_path / "cache")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: _sample(tiny_config, "--compilation-cache", cache), range(3)))
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    assert len({r.stdout for r in results}) == 1


def test_off_writes_nothing_and_a_gcs_cache_without_epath_is_a_one_line_error(tiny_config, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    off = _sample(tiny_config, "--compilation-cache", "off")
    assert off.returncode == 0 and "compilation cache off" in off.stderr, off.stderr
    assert not (tmp_path / "xdg").exists()
    gcs = _sample(tiny_config, "--compilation-cache", "gs://bucket/cache")
    assert gcs.returncode == 2 and gcs.stderr.splitlines()[-1].startswith("error: --compilation-cache gs://"), \
        gcs.stderr
