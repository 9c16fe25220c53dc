import os
import subprocess
import sys

SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
from mesh_transformer.cli import keep_host_memory
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
    from mesh_transformer.cli import KEEP_HOST_MEMORY

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    lines = run(tmp_path, env)
    # Before the restart, then the same process (same pid) again from the top, now with the tunables and the args.
    assert [line[1] for line in lines] == ["None", KEEP_HOST_MEMORY, KEEP_HOST_MEMORY]
    assert lines[0][0] == lines[1][0] == lines[2][0]
    assert lines[2][2] == "['--flag', 'x']"


def test_keep_host_memory_leaves_a_users_tunables_alone(tmp_path):
    lines = run(tmp_path, {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert [line[1] for line in lines] == ["glibc.malloc.arena_max=2"] * 2


def test_device_out_of_memory_is_one_line_saying_what_was_asked_and_what_to_change():
    import jax

    from mesh_transformer.cli import out_of_memory_message

    error = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 47559058040 bytes.\nmore")
    message = out_of_memory_message(error)
    assert message.startswith("out of device memory (Out of memory allocating 47559058040 bytes.); ")
    assert "--dtype bf16" in message and "--mp" in message and "\n" not in message
    assert out_of_memory_message(jax.errors.JaxRuntimeError("INTERNAL: other")) is None
    assert out_of_memory_message(ValueError("RESOURCE_EXHAUSTED")) is None
