"""The server's sizing (serve/sizing.py): auto pages fill what a device's memory budget leaves and no more, a setting
that cannot fit is refused naming the flags that would help, and the programs it compiles are the engine's own."""
import os
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest

from mesh_transformer import config
from mesh_transformer.infer.pages import pages_for
from mesh_transformer.infer.params import make_inference_layout
from mesh_transformer.infer.programs import Programs
from mesh_transformer.parallel.mesh import make_dp_mp
from mesh_transformer.platforms import KEEP_HOST_MEMORY
from mesh_transformer.serve import sizing
from mesh_transformer.serve.engine import Engine
from mesh_transformer.store import checkpoint
from mesh_transformer.tokenizer import load_tokenizer
from tests.helpers import REPO_ROOT, make_config, random_params, run_script, save_config, wait_for

CFG = config.from_dict({"layers": 2, "d_model": 32, "n_heads": 4, "n_vocab": 512, "pe_rotary_dims": 4, "seq": 64,
                        "cores_per_replica": 4, "remat": False})
PAGE, BATCH = 16, 8
WIDTH = pages_for(CFG.seq, PAGE)  # pages of one whole context


@pytest.fixture(scope="module")
def programs():
    return Programs(make_inference_layout(CFG, mesh=make_dp_mp(2, 4)))


def server(programs, n_pages, device_bytes, fraction=0.9, max_batch=BATCH):
    return sizing.for_server(programs, max_batch=max_batch, n_pages=n_pages, page_size=PAGE, prefix_cache=True,
                             memory_fraction=fraction, device_bytes=device_bytes)


@pytest.fixture(scope="module")
def costs(programs):
    """(fixed bytes, bytes a page) on one device, from auto pages in plenty of memory and twice as many pages."""
    plenty = server(programs, "auto", 1 << 30)
    given = server(programs, 2 * plenty.n_pages, 4 << 30)
    per_page = (given.need_bytes - plenty.need_bytes) / plenty.n_pages
    return plenty.need_bytes - per_page * plenty.n_pages, per_page


def test_auto_pages_fill_the_budget_and_one_more_page_per_group_would_not_fit(programs, costs):
    fixed, per_page = costs
    device_bytes = int((fixed + 37.5 * 2 * per_page) / 0.9)  # 37.5 pages a dp group
    auto = server(programs, "auto", device_bytes)
    assert auto.n_pages == 74 and auto.n_pages % 2 == 0
    assert auto.need_bytes <= auto.budget_bytes < auto.need_bytes + 2 * per_page
    assert server(programs, auto.n_pages, device_bytes).need_bytes == auto.need_bytes
    with pytest.raises(config.ConfigError, match=r"the server does not fit: paged_.* try fewer --kv-pages"):
        server(programs, auto.n_pages + 2, device_bytes)


def test_too_little_memory_for_a_context_per_group_is_refused_with_advice(programs, costs):
    fixed, per_page = costs
    device_bytes = int((fixed + (2 * WIDTH - 2) * per_page) / 0.9)
    with pytest.raises(config.ConfigError) as refused:
        server(programs, "auto", device_bytes)
    message = str(refused.value)
    assert "fewer than one context of 64 tokens per data-parallel group (8 pages in all)" in message
    assert "--kv-cache-dtype int8" in message and "--dtype int8" in message and "--memory-fraction" in message
    assert "\n" not in message
    assert server(programs, "auto", 2 * device_bytes).n_pages >= 2 * WIDTH


def test_the_slot_cache_is_checked_and_its_refusal_suggests_pages(programs):
    slots = server(programs, "off", 1 << 30)
    assert slots.n_pages is None and slots.need_bytes > slots.cache_bytes + slots.weights_bytes
    with pytest.raises(config.ConfigError, match=r"--kv-pages auto .* a smaller --max-batch \(now 8\)"):
        server(programs, "off", slots.need_bytes)


def test_where_the_device_reports_no_memory_auto_is_a_context_per_slot(programs):
    """The CPU's devices report none: device_serve.py's auto there is what the slot cache holds."""
    fit = sizing.for_server(programs, max_batch=BATCH, n_pages="auto", page_size=PAGE, prefix_cache=True,
                            memory_fraction=0.9)
    assert fit.n_pages == BATCH * WIDTH


def test_the_engine_runs_the_programs_sizing_compiled(programs):
    """An engine on the sized pages compiles at warm-up only what sizing did not."""
    layout = programs.layout
    fit = server(programs, 6 * WIDTH, 1 << 30)
    compiled = programs.traces
    engine = Engine(layout, random_params(CFG, 0), load_tokenizer(), max_batch=BATCH, programs=programs,
                    n_pages=fit.n_pages, page_size=PAGE, warm_up=True)
    try:
        assert engine.warmed.wait(timeout=600)
        assert programs.traces - compiled == len(engine.programs()) - len(sizing.largest(engine.programs()))
    finally:
        engine.close()
    assert np.isfinite(fit.need_bytes)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A config of CFG's model (GPT-2's vocabulary) whose model_dir holds a checkpoint of random weights."""
    tmp_path = tmp_path_factory.mktemp("served")
    cfg = make_config(tmp_path, **{k: getattr(CFG, k) for k in ("layers", "d_model", "n_heads", "pe_rotary_dims")},
                      n_vocab=50304, seq=64, cores_per_replica=2, model_dir=str(tmp_path / "ckpt"))
    checkpoint.save(cfg.model_dir, 1, {"step": np.int32(1), "params": random_params(cfg, 0)}, blocking=True)
    return cfg, save_config(tmp_path, cfg)


def test_device_serve_refuses_a_setting_that_cannot_fit_before_reading_the_weights(saved, tmp_path):
    cfg, path = saved
    missing = str(tmp_path / "no_weights_here")  # reading them would fail otherwise
    result = run_script("device_serve.py", "--config", path, "--set", f"model_dir={missing}", "--kv-pages", "auto",
                        "--memory-fraction", "1e-9")
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the KV cache does not fit") and "--memory-fraction" in last, result.stderr
    assert "loading layers" not in result.stderr and "Traceback" not in result.stderr


def test_device_serve_sizes_its_pages_and_answers(saved):
    cfg, path = saved
    with socket.socket() as s:  # a free port for the server to bind
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "device_serve.py", "--config", path, "--kv-cache-dtype", "int8",
                             "--max-batch", "4", "--port", str(port)], cwd=REPO_ROOT, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "GLIBC_TUNABLES": KEEP_HOST_MEMORY})
    try:
        wait_for(lambda: _healthy(port), proc)
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                              json={"prompt": "Hello world", "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8, response.text
        pages = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["pages"]
        assert pages["total"] == 4 * pages_for(cfg.seq, PAGE)  # a context per slot: the CPU reports no memory
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert "memory per device:" in stderr and f"({4 * pages_for(cfg.seq, PAGE)} pages)" in stderr, stderr


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False
