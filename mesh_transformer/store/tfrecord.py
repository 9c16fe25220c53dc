"""TFRecord files of tf.train.Example protos, read and written byte for byte as TensorFlow does, without TensorFlow.

Framing of one record: uint64 length (little endian), uint32 masked CRC32C of those 8 bytes, the data, uint32 masked
CRC32C of the data. The data is a serialized tf.train.Example; only int64-list features are supported, which is all
the token files need:
  Example{features=1: Features{feature=1: map<string, Feature>}}, Feature{int64_list=3: Int64List{value=1}}.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Mapping
from typing import IO

import google_crc32c
import numpy as np

from mesh_transformer import storage

HEADER_BYTES = 12  # uint64 length + uint32 masked crc of the length
FOOTER_BYTES = 4  # uint32 masked crc of the data
_CRC_MASK_DELTA = 0xA282EAD8
_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5


class DataError(ValueError):
    """A data file or index a user must fix: missing, empty, corrupt, or of the wrong shape."""


def masked_crc32c(data: bytes) -> int:
    """TFRecord's CRC: CRC32C rotated right by 15 bits plus a constant, so CRCs of CRCs stay well spread."""
    crc = google_crc32c.value(bytes(data))
    return (((crc >> 15) | (crc << 17)) + _CRC_MASK_DELTA) & 0xFFFFFFFF


def frame_record(data: bytes) -> bytes:
    """One record's bytes as they sit in a .tfrecords file."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# ---- protobuf wire format, the few pieces tf.train.Example needs ----

def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s are 10-byte two's complement on the wire
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_field(field: int, payload: bytes) -> bytes:
    return varint(field << 3 | _WIRE_LEN) + varint(len(payload)) + payload


def encode_packed_varints(values_N: np.ndarray) -> bytes:
    """Int64 values as one packed varint run, vectorized (a record holds thousands of tokens)."""
    v_N = np.asarray(values_N, np.int64).reshape(-1).view(np.uint64)
    n_bytes_N = np.ones(v_N.shape, np.int64)
    for k in range(1, 10):
        n_bytes_N += v_N >= np.uint64(1 << (7 * k))
    owner_B = np.repeat(np.arange(v_N.size), n_bytes_N)
    first_B = np.repeat(np.cumsum(n_bytes_N) - n_bytes_N, n_bytes_N)
    index_B = np.arange(owner_B.size) - first_B
    payload_B = (v_N[owner_B] >> (7 * index_B).astype(np.uint64)) & np.uint64(0x7F)
    more_B = (index_B < n_bytes_N[owner_B] - 1).astype(np.uint64) << np.uint64(7)
    return (payload_B | more_B).astype(np.uint8).tobytes()


def decode_packed_varints(buf: bytes | memoryview) -> np.ndarray:
    """A packed varint run back to int64 values, vectorized."""
    b_B = np.frombuffer(buf, np.uint8)
    if b_B.size == 0:
        return np.zeros(0, np.int64)
    ends_N = np.flatnonzero(b_B < 0x80)
    if ends_N.size == 0 or ends_N[-1] != b_B.size - 1:
        raise ValueError("truncated packed varint")
    starts_N = np.concatenate([[0], ends_N[:-1] + 1])
    lengths_N = ends_N - starts_N + 1
    if lengths_N.max() > 10:
        raise ValueError("varint longer than 10 bytes")
    shift_B = (np.arange(b_B.size) - np.repeat(starts_N, lengths_N)) * 7
    parts_B = (b_B & 0x7F).astype(np.uint64) << shift_B.astype(np.uint64)
    return np.bitwise_or.reduceat(parts_B, starts_N).view(np.int64)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field of one message; length-delimited values stay unparsed."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _WIRE_VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire in (_WIRE_FIXED64, _WIRE_FIXED32, _WIRE_LEN):
            if wire == _WIRE_LEN:
                size, pos = _read_varint(buf, pos)
            else:
                size = 8 if wire == _WIRE_FIXED64 else 4
            if pos + size > len(buf):
                raise ValueError(f"field {field} runs past the end of its message")
            value, pos = buf[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in field {field}")
        yield field, wire, value


def encode_example(features: Mapping[str, np.ndarray]) -> bytes:
    """A tf.train.Example with one int64-list feature per key, serialized as TensorFlow serializes it."""
    entries = b""
    for key, values in features.items():
        packed = encode_packed_varints(values)
        int64_list = len_field(1, packed) if packed else b""  # proto3 omits an empty packed field
        feature = len_field(3, int64_list)
        entries += len_field(1, len_field(1, key.encode()) + len_field(2, feature))
    return len_field(1, entries)


def _decode_int64_list(buf: memoryview) -> np.ndarray:
    chunks = []
    for field, wire, value in _fields(buf):
        if field != 1:
            continue
        if wire == _WIRE_LEN:
            chunks.append(decode_packed_varints(value))
        elif wire == _WIRE_VARINT:  # unpacked writers put one value per field
            chunks.append(np.array([value], np.uint64).view(np.int64))
        else:
            raise ValueError(f"Int64List value has wire type {wire}")
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


def decode_example(data: bytes | memoryview) -> dict[str, np.ndarray]:
    """The int64-list features of a serialized tf.train.Example; bytes and float features are skipped."""
    features: dict[str, np.ndarray] = {}
    for field, wire, features_buf in _fields(memoryview(data)):
        if field != 1 or wire != _WIRE_LEN:
            continue
        for entry_field, entry_wire, entry in _fields(features_buf):
            if entry_field != 1 or entry_wire != _WIRE_LEN:
                continue
            key, values = "", None
            for f, w, v in _fields(entry):
                if f == 1 and w == _WIRE_LEN:
                    key = bytes(v).decode()
                elif f == 2 and w == _WIRE_LEN:
                    lists = [_decode_int64_list(lv) for lf, lw, lv in _fields(v) if lf == 3 and lw == _WIRE_LEN]
                    values = np.concatenate(lists) if lists else None
            if values is not None:
                features[key] = values  # map semantics: a repeated key keeps the last entry
    return features


# ---- files ----

def write_records(path: str, records: Iterable[bytes]) -> int:
    """Write framed records to a file atomically; returns how many were written."""
    parts = [frame_record(r) for r in records]
    storage.write_bytes_atomic(path, b"".join(parts))
    return len(parts)


def _read_exact(f: IO, n: int, path: str, offset: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DataError(f"{path}: truncated TFRecord at byte offset {offset}: {what} needs {n} bytes, "
                        f"found {len(data)}")
    return data


def _read_length(f: IO, path: str, offset: int) -> int | None:
    """The data length from the header at `offset` (the file is positioned there), or None at a clean end of file."""
    header = f.read(HEADER_BYTES)
    if not header:
        return None
    if len(header) != HEADER_BYTES:
        raise DataError(f"{path}: truncated TFRecord at byte offset {offset}: header needs {HEADER_BYTES} bytes, "
                        f"found {len(header)}")
    (length,) = struct.unpack("<Q", header[:8])
    (crc,) = struct.unpack("<I", header[8:])
    if crc != masked_crc32c(header[:8]):
        raise DataError(f"{path}: corrupt TFRecord at byte offset {offset}: length CRC mismatch")
    return length


def _read_data(f: IO, length: int, path: str, offset: int) -> bytes:
    """The data and its CRC after a header; the file is positioned just past the header."""
    data = _read_exact(f, length, path, offset, "data")
    (crc,) = struct.unpack("<I", _read_exact(f, FOOTER_BYTES, path, offset, "data CRC"))
    if crc != masked_crc32c(data):
        raise DataError(f"{path}: corrupt TFRecord at byte offset {offset}: data CRC mismatch")
    return data


def read_record_at(f: IO, offset: int, path: str) -> bytes:
    """The data of the record starting at byte `offset`, both CRCs checked; `path` names the file in errors."""
    f.seek(offset)
    length = _read_length(f, path, offset)
    if length is None:
        raise DataError(f"{path}: no TFRecord at byte offset {offset}: end of file")
    return _read_data(f, length, path, offset)


def iter_records(path: str) -> Iterator[bytes]:
    """Every record's data in file order, CRCs checked."""
    with storage.open_file(path, "rb") as f:
        offset = 0
        while (length := _read_length(f, path, offset)) is not None:
            yield _read_data(f, length, path, offset)
            offset += HEADER_BYTES + length + FOOTER_BYTES


def scan_offsets(path: str) -> np.ndarray:
    """Byte offsets of every record in a file, from the length headers alone (data is seeked past, not read)."""
    offsets = []
    with storage.open_file(path, "rb") as f:
        size = f.seek(0, 2)
        offset = 0
        f.seek(0)
        while (length := _read_length(f, path, offset)) is not None:
            end = offset + HEADER_BYTES + length + FOOTER_BYTES
            if end > size:
                raise DataError(f"{path}: truncated TFRecord at byte offset {offset}: record needs {end - offset} "
                                f"bytes, the file has {size - offset} left")
            offsets.append(offset)
            offset = end
            f.seek(offset)
    return np.asarray(offsets, np.int64)
