"""The arrays of an .npz file read from where np.savez left them: each member an uncompressed zip entry holding an .npy
file, so its data is read by one positional read straight into the array, its CRC-32 checked as zipfile would, with no
zip stream in between. Reads take no lock on a local file, so threads read members of one file at once (the reads
and zlib's CRC release the GIL). Local or gs:// (there, reads of one file take turns). A member np.savez would not
have written so (compressed, Fortran order, of objects, an .npy version numpy reads no other way) is read through
zipfile.
"""
from __future__ import annotations

import contextlib
import io
import os
import struct
import threading
import zipfile
import zlib
from typing import IO, NamedTuple

import numpy as np

from mesh_transformer import storage

_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip entry's local header; its last two fields: name and extra lengths
_NPY_PREFIX = 12  # magic (6), version (2), header length (2 in version 1, 4 in version 2)
# Held while numpy parses an .npy header: it does so with ast.literal_eval, which CPython 3.11 cannot run in several
# threads at once (a reader's threads parse shards' headers side by side: "SystemError: AST constructor recursion
# depth mismatch").
HEADER_LOCK = threading.Lock()


class Member(NamedTuple):
    """One array of the file: its shape and dtype as stored, where its data starts, the .npy header before it (the
    CRC covers both), and whether it is read through zipfile instead (`direct` False)."""
    shape: tuple[int, ...]
    dtype: np.dtype
    data_offset: int
    npy_header: bytes
    direct: bool


class Archive:
    """An open .npz file: its members' names, their shapes and dtypes, and their arrays, read by any thread."""

    def __init__(self, path: str):
        self.path = path
        self._handle: IO = storage.open_file(path, "rb")
        self._zip = zipfile.ZipFile(self._handle)
        self._fd = None if storage.is_gcs(path) else os.open(path, os.O_RDONLY)
        self._lock = threading.Lock()  # the handle's position (zipfile's reads; every read of a gs:// file)
        self._members: dict[str, Member] = {}

    def names(self) -> list[str]:
        return self._zip.namelist()

    def member(self, name: str) -> Member:
        """A member's shape, dtype and place, parsed from its headers on first use."""
        if name not in self._members:
            self._members[name] = self._parse(name)
        return self._members[name]

    def read(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """A member's array (bfloat16 saved by numpy stays void 'V2'); with `out` (C-contiguous, as many bytes), read
        into it, whatever its dtype."""
        member = self.member(name)
        if not member.direct:
            with self._lock, self._zip.open(name) as fp:
                array = np.lib.format.read_array(fp, allow_pickle=False)
            return array if out is None else _filled(out, array)
        array = np.empty(member.shape, member.dtype) if out is None else out
        data = array.reshape(-1).view(np.uint8)
        if data.size != int(np.prod(member.shape)) * member.dtype.itemsize:
            raise ValueError(f"{self.path}:{name} holds {member.shape} {member.dtype}, not {array.shape} {array.dtype}")
        self._read_into(member.data_offset, data)
        crc = zlib.crc32(data, zlib.crc32(member.npy_header))
        if crc != self._zip.getinfo(name).CRC:
            raise zipfile.BadZipFile(f"bad CRC-32 for {self.path}:{name}: the file is corrupt")
        return array

    def close(self) -> None:
        self._zip.close()
        self._handle.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _parse(self, name: str) -> Member:
        info = self._zip.getinfo(name)
        if info.compress_type != zipfile.ZIP_STORED:
            return self._through_zipfile(name)
        local = self._pread(info.header_offset, _LOCAL_HEADER.size)
        start = info.header_offset + _LOCAL_HEADER.size + sum(_LOCAL_HEADER.unpack(local)[-2:])
        prefix = self._pread(start, _NPY_PREFIX)
        version = np.lib.format.read_magic(io.BytesIO(prefix))
        if version not in ((1, 0), (2, 0)):
            return self._through_zipfile(name)
        length = 10 + struct.unpack("<H", prefix[8:10])[0] if version == (1, 0) else \
            12 + struct.unpack("<I", prefix[8:12])[0]
        header = self._pread(start, length)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        fp = io.BytesIO(header)
        np.lib.format.read_magic(fp)
        with HEADER_LOCK:
            shape, fortran_order, dtype = read_header(fp)
        return Member(tuple(shape), dtype, start + length, header, not fortran_order and not dtype.hasobject)

    def _through_zipfile(self, name: str) -> Member:
        with self._lock, HEADER_LOCK, self._zip.open(name) as fp:  # rare: read whole once for its shape and dtype
            array = np.lib.format.read_array(fp, allow_pickle=False)
        return Member(array.shape, array.dtype, 0, b"", False)

    def _pread(self, offset: int, size: int) -> bytes:
        data = np.empty(size, np.uint8)
        self._read_into(offset, data)
        return data.tobytes()

    def _read_into(self, offset: int, data: np.ndarray) -> None:
        """data[:] = the file's bytes from `offset`."""
        view, done = memoryview(data), 0
        with self._lock if self._fd is None else contextlib.nullcontext():
            if self._fd is None:
                self._handle.seek(offset)
            while done < len(view):
                if self._fd is None:
                    chunk = self._handle.read(len(view) - done)
                    view[done:done + len(chunk)] = chunk
                    got = len(chunk)
                else:
                    got = os.preadv(self._fd, [view[done:]], offset + done)
                if not got:
                    raise zipfile.BadZipFile(f"{self.path} ends inside a member: the file is truncated")
                done += got


def _filled(out: np.ndarray, array: np.ndarray) -> np.ndarray:
    out.reshape(-1).view(np.uint8)[...] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return out
