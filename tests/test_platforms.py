import os
import subprocess
import sys

SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from mesh_transformer.platforms import keep_host_memory
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), flush=True)
keep_host_memory()
print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), sys.argv[1:], flush=True)
"""


def run(tmp_path, env):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(root=os.getcwd()))
    out = subprocess.run([sys.executable, str(script), "--flag", "x"], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [line.split(" ", 2) for line in out.splitlines()]


def test_keep_host_memory_restarts_once_with_malloc_tunables(tmp_path):
    from mesh_transformer.platforms import KEEP_HOST_MEMORY

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    lines = run(tmp_path, env)
    # Before the restart, then the same process (same pid) again from the top, now with the tunables and the args.
    assert [line[1] for line in lines] == ["None", KEEP_HOST_MEMORY, KEEP_HOST_MEMORY]
    assert lines[0][0] == lines[1][0] == lines[2][0]
    assert lines[2][2] == "['--flag', 'x']"


def test_keep_host_memory_leaves_a_users_tunables_alone(tmp_path):
    lines = run(tmp_path, {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert [line[1] for line in lines] == ["glibc.malloc.arena_max=2"] * 2


def test_keep_host_memory_does_not_restart_for_an_accelerator(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    lines = run(tmp_path, {**env, "JAX_PLATFORMS": "cuda"})
    assert [line[1] for line in lines] == ["None", "None"]


def test_platform_setup_adds_the_gpu_flags_on_gpu_only(tmp_path):
    from mesh_transformer.platforms import GPU_XLA_FLAGS

    script = tmp_path / "flags.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {os.getcwd()!r})\nfrom mesh_transformer import platforms\n"
                      "platforms.platform_setup()\nprint(os.environ.get('XLA_FLAGS'))\n")
    env = {**os.environ, "GLIBC_TUNABLES": "", "XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}

    def flags(platform):
        return subprocess.run([sys.executable, str(script)], env={**env, "JAX_PLATFORMS": platform},
                              capture_output=True, text=True, check=True, timeout=60).stdout.split()

    assert flags("cpu") == ["--xla_gpu_enable_latency_hiding_scheduler=false"]
    assert flags("cuda") == ["--xla_gpu_enable_latency_hiding_scheduler=false", *GPU_XLA_FLAGS[1:]]  # user's wins


def test_the_gpu_flags_are_known_to_this_jaxlib():
    """XLA aborts on an unknown flag; its GPU flags are registered in every build, so a CPU run catches a renamed
    one before it reaches a GPU."""
    from mesh_transformer.platforms import GPU_XLA_FLAGS

    env = {**os.environ, "XLA_FLAGS": " ".join(GPU_XLA_FLAGS), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(int(jnp.ones(3).sum()))"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr[-500:]


RSS_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
import numpy as np
from mesh_transformer.platforms import host_memory_returned, keep_host_memory
keep_host_memory()

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2 ** 20

def freed_after(n_mb):
    start = rss_mb()
    blocks = [np.ones(2 ** 20, np.uint8) for _ in range(n_mb)]  # 1 MiB blocks, as a model's leaves are large ones
    del blocks
    return rss_mb() - start

kept = freed_after(256)
with host_memory_returned():
    returned = freed_after(256)
print(kept, returned, flush=True)
"""


def test_host_memory_returned_gives_freed_blocks_back_inside_the_kept_memory_process(tmp_path):
    script = tmp_path / "rss.py"
    script.write_text(RSS_SCRIPT.format(root=os.getcwd()))
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    kept, returned = map(int, subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                                             check=True, timeout=60).stdout.split())
    assert kept >= 200 and returned <= 16, (kept, returned)


def test_jax_starts_on_the_attached_platform_and_the_cpu_only(monkeypatch):
    # A TPU VM with the dev install (the CUDA plugin too) must not have JAX try CUDA and print its failure.
    from mesh_transformer import platforms

    for platform, wanted in ((platforms.TPU, "tpu,cpu"), (platforms.GPU, "cuda,cpu"), (platforms.CPU, "cpu")):
        monkeypatch.delenv("JAX_PLATFORMS")
        monkeypatch.setattr(platforms, "expected_platform", lambda platform=platform: platform)
        platforms.pin_platform()
        assert os.environ["JAX_PLATFORMS"] == wanted
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(platforms, "expected_platform", lambda: platforms.TPU)
    platforms.pin_platform()
    assert os.environ["JAX_PLATFORMS"] == "cpu"  # the user's choice stands


def test_the_pallas_kernels_are_the_tpu_policys_where_mosaic_has_bf16_products():
    from mesh_transformer.platforms import for_platform

    kinds = {kind: (for_platform("tpu", kind).paged_attention, for_platform("tpu", kind).attention,
                    for_platform("tpu", kind).int8_dot, for_platform("tpu", kind).decode_attention)
             for kind in ("TPU v3", "TPU v4", "TPU v5 lite", "TPU v6 lite")}
    pallas = ("kernel", "splash", "kernel", "kernel")
    assert kinds == {"TPU v3": ("gather", "xla", "compute", "xla"), "TPU v4": pallas, "TPU v5 lite": pallas,
                     "TPU v6 lite": pallas}
    assert for_platform("cpu").paged_attention == for_platform("gpu").paged_attention == "gather"
    assert for_platform("cpu").decode_attention == for_platform("gpu").decode_attention == "xla"


def test_splash_is_a_layouts_attention_under_gspmd_split_by_rows_and_heads():
    import jax
    from jax.sharding import PartitionSpec as P

    from mesh_transformer.parallel.mesh import make_mesh
    from mesh_transformer.platforms import for_layout, for_platform

    tpu = for_platform("tpu", "TPU v5 lite")
    one, eight = make_mesh({"data": 1}, jax.devices()[:1]), make_mesh({"data": 4, "tensor": 2}, jax.devices()[:8])
    assert for_layout(tpu, True, one, P("data", None, None, None)) == tpu
    assert for_layout(tpu, gspmd=False).attention == "xla"
    split = for_layout(tpu, True, eight, P("data", None, "tensor", None))
    assert split.attention == "splash" and split.attention_shards == (eight, P("data", None, "tensor", None))
    for positions_or_head_dim in (P("data", "tensor", None, None), P("data", None, None, "tensor")):
        assert for_layout(tpu, True, eight, positions_or_head_dim).attention == "xla"
    assert for_layout(for_platform("gpu"), True, eight, P("data")).attention == "cudnn"
    assert for_layout(for_platform("cpu"), True, one, P()) == for_platform("cpu")
