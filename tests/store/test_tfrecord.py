"""TFRecord framing and tf.train.Example coding, checked against bytes assembled by hand and the protobuf runtime."""
import re
import struct
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

from mesh_transformer.store import tfrecord
from mesh_transformer.store.tfrecord import DataError


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        out += bytes([low | (0x80 if n else 0)])
        if not n:
            return out


def _masked(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _hand_record(tokens: list[int], packed: bool = True) -> bytes:
    """One framed record holding tf.train.Example{"text": Int64List(tokens)}, assembled byte by byte."""
    if packed:
        payload = b"".join(varint(t) for t in tokens)
        int64_list = b"\x0a" + varint(len(payload)) + payload  # field 1, wire type 2
    else:
        int64_list = b"".join(b"\x08" + varint(t) for t in tokens)  # field 1, wire type 0, one per value
    feature = b"\x1a" + varint(len(int64_list)) + int64_list  # Feature.int64_list = 3
    entry = b"\x0a\x04text" + b"\x12" + varint(len(feature)) + feature  # map entry: key = 1, value = 2
    features = b"\x0a" + varint(len(entry)) + entry  # Features.feature = 1
    example = b"\x0a" + varint(len(features)) + features  # Example.features = 1
    length = struct.pack("<Q", len(example))
    return length + struct.pack("<I", _masked(length)) + example + struct.pack("<I", _masked(example))


def test_masked_crc_known_answer():
    # CRC32C("123456789") = 0xE3069283, the standard check value; the mask is TFRecord's.
    assert google_crc32c.value(b"123456789") == 0xE3069283
    assert tfrecord.masked_crc32c(b"123456789") == (((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xA282EAD8) % 2**32
    assert tfrecord.masked_crc32c(b"") == 0xA282EAD8


def test_packed_varints_match_reference_and_round_trip():
    values = np.array([0, 1, 127, 128, 300, 16383, 16384, 50256, 2**31, 2**62, 2**63 - 1, -1, -50256], np.int64)
    encoded = tfrecord.encode_packed_varints(values)
    assert encoded == b"".join(varint(int(v)) for v in values)
    np.testing.assert_array_equal(tfrecord.decode_packed_varints(encoded), values)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_hand_built_record_reads_back(tmp_path, packed):
    tokens = [0, 1, 300, 50256, 12]
    path = str(tmp_path / "hand.tfrecords")
    with open(path, "wb") as f:
        f.write(_hand_record(tokens, packed) + _hand_record(tokens[::-1], packed))
    records = [tfrecord.decode_example(r)["text"].tolist() for r in tfrecord.iter_records(path)]
    assert records == [tokens, tokens[::-1]]
    assert tfrecord.scan_offsets(path).tolist() == [0, len(_hand_record(tokens, packed))]


def test_written_file_equals_hand_built_bytes(tmp_path):
    path = str(tmp_path / "ours.tfrecords")
    assert tfrecord.write_records(path, [tfrecord.encode_example({"text": np.array([7, 300, 50256])})]) == 1
    assert Path(path).read_bytes() == _hand_record([7, 300, 50256])


def test_example_bytes_match_protobuf_runtime():
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="tf_example_test.proto", package="tensorflow", syntax="proto3")
    proto.message_type.add(name="Int64List").field.add(name="value", number=1, type=field.TYPE_INT64,
                                                       label=field.LABEL_REPEATED)
    proto.message_type.add(name="Feature").field.add(name="int64_list", number=3, type=field.TYPE_MESSAGE,
                                                     type_name=".tensorflow.Int64List", label=field.LABEL_OPTIONAL)
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=field.TYPE_MESSAGE, type_name=".tensorflow.Feature",
                    label=field.LABEL_OPTIONAL)
    features.field.add(name="feature", number=1, type=field.TYPE_MESSAGE,
                       type_name=".tensorflow.Features.FeatureEntry", label=field.LABEL_REPEATED)
    proto.message_type.add(name="Example").field.add(name="features", number=1, type=field.TYPE_MESSAGE,
                                                     type_name=".tensorflow.Features", label=field.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    example_cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))

    tokens = [3, 300, 50256, 0, 2**40]
    example = example_cls()
    example.features.feature["text"].int64_list.value.extend(tokens)
    ours = tfrecord.encode_example({"text": np.array(tokens)})
    assert ours == example.SerializeToString(deterministic=True)
    parsed = example_cls()
    parsed.ParseFromString(ours)
    assert list(parsed.features.feature["text"].int64_list.value) == tokens


def _three_records(tmp_path) -> tuple[str, list[int]]:
    path = str(tmp_path / "three.tfrecords")
    records = [_hand_record(list(range(i, i + 20))) for i in range(3)]
    with open(path, "wb") as f:
        f.write(b"".join(records))
    return path, [0, len(records[0]), len(records[0]) + len(records[1])]


def test_flipped_data_byte_names_file_and_offset(tmp_path):
    path, offsets = _three_records(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[offsets[1] + tfrecord.HEADER_BYTES + 5] ^= 0x01
    Path(path).write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{re.escape(path)}: corrupt TFRecord at byte offset {offsets[1]}: data CRC"):
        list(tfrecord.iter_records(path))
    with open(path, "rb") as f, pytest.raises(DataError, match=f"byte offset {offsets[1]}"):
        tfrecord.read_record_at(f, offsets[1], path)


def test_flipped_length_byte_names_file_and_offset(tmp_path):
    path, offsets = _three_records(tmp_path)
    data = bytearray(Path(path).read_bytes())
    data[offsets[2]] ^= 0x01
    Path(path).write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{re.escape(path)}: corrupt TFRecord at byte offset {offsets[2]}: length CRC"):
        tfrecord.scan_offsets(path)


def test_truncated_file_names_file_and_offset(tmp_path):
    path, offsets = _three_records(tmp_path)
    Path(path).write_bytes(Path(path).read_bytes()[:-3])
    with pytest.raises(DataError, match=f"{re.escape(path)}: truncated TFRecord at byte offset {offsets[2]}"):
        tfrecord.scan_offsets(path)
    with pytest.raises(DataError, match=f"{re.escape(path)}: truncated TFRecord at byte offset {offsets[2]}"):
        list(tfrecord.iter_records(path))
