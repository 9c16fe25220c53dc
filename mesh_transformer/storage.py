"""File I/O for local paths and gs:// URLs, one API for both.

Local writes are atomic through a temporary file and `os.replace`; GCS object writes are atomic by nature (an object
appears only when its upload completes). Set STORAGE_EMULATOR_HOST to talk to a GCS emulator.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

import smart_open


def is_gcs(path: str) -> bool:
    return path.startswith("gs://")


def join(base: str, *parts: str) -> str:
    if is_gcs(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def _gcs_client():
    from google.cloud import storage as gcs

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        return gcs.Client(project="test", credentials=AnonymousCredentials())
    return gcs.Client()


def _split_gcs(path: str) -> tuple[str, str]:
    bucket, _, name = path[len("gs://"):].partition("/")
    return bucket, name


def open_file(path: str, mode: str = "rb") -> IO:
    """Open a local path or gs:// URL for streaming read or write."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound

        try:
            return smart_open.open(path, mode, transport_params={"client": _gcs_client()})
        except NotFound as e:
            # Same exception as a missing local file, so callers handle both with one except clause.
            raise FileNotFoundError(f"no such GCS object: {path}") from e
    if "w" in mode or "a" in mode:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return open(path, mode)


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def _umask() -> int:
    """The process's umask (read by setting it, then setting it back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write a whole file so that readers see either nothing or all of it."""
    if is_gcs(path):
        with open_file(path, "wb") as f:
            f.write(data)
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # as open() would make it: mkstemp's 0600 would hide it from others
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def exists(path: str) -> bool:
    if is_gcs(path):
        bucket, name = _split_gcs(path)
        client = _gcs_client()
        if client.bucket(bucket).blob(name).exists():
            return True
        return any(True for _ in client.list_blobs(bucket, prefix=name.rstrip("/") + "/", max_results=1))
    return os.path.exists(path)


def listdir(path: str) -> list[str]:
    """Names of the direct children of a directory (or GCS prefix), sorted."""
    if is_gcs(path):
        bucket, prefix = _split_gcs(path)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        blobs = _gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/")
        names = [b.name[len(prefix):] for b in blobs]
        names += [p[len(prefix):].rstrip("/") for p in blobs.prefixes]
        return sorted(n for n in set(names) if n)
    if not os.path.isdir(path):
        return []
    return sorted(os.listdir(path))


def walk_files(path: str) -> Iterator[str]:
    """Every file below a directory (or GCS prefix), as full paths."""
    if is_gcs(path):
        bucket, prefix = _split_gcs(path)
        prefix = prefix.rstrip("/") + "/"
        for blob in _gcs_client().list_blobs(bucket, prefix=prefix):
            yield f"gs://{bucket}/{blob.name}"
        return
    for root, _, files in os.walk(path):
        for name in files:
            yield os.path.join(root, name)


def remove_tree(path: str) -> None:
    if is_gcs(path):
        bucket, prefix = _split_gcs(path)
        client = _gcs_client()
        for blob in client.list_blobs(bucket, prefix=prefix.rstrip("/") + "/"):
            blob.delete()
        return
    shutil.rmtree(path, ignore_errors=True)


def makedirs(path: str) -> None:
    """Create a local directory; a no-op on GCS, where directories are implied by object names."""
    if not is_gcs(path):
        os.makedirs(path, exist_ok=True)
