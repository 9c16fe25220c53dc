"""Token datasets: index files, deterministic resumable order, process split, mixtures, val batches, clear errors."""
import json
import os
import re

import numpy as np
import pytest

from mesh_transformer.train import data
from mesh_transformer.train.data import DataError, RecordFiles, TokenDataset, val_batches
from mesh_transformer.store.tfrecord import encode_example, write_records

SEQ = 7


def _tokens(source: int, file_i: int, record_i: int, length: int = SEQ + 1) -> np.ndarray:
    """A record whose first token says where it came from."""
    return np.concatenate([[source * 10_000 + file_i * 100 + record_i], np.arange(length - 1)])


def _make_index(folder, counts, source=0, count_in_name=True, relative=True) -> str:
    """Write record files with `counts[i]` records each and an index listing them; returns the index path."""
    os.makedirs(folder, exist_ok=True)
    names = []
    for file_i, n in enumerate(counts):
        name = f"part_{file_i}_{n}.tfrecords" if count_in_name else f"part{file_i}.tfrecords"
        write_records(os.path.join(folder, name),
                      [encode_example({"text": _tokens(source, file_i, r)}) for r in range(n)])
        names.append(name if relative else os.path.join(folder, name))
    index = os.path.join(folder, "set.index")
    with open(index, "w") as f:
        f.write("\n".join(names) + "\n")
    return index


def _ids(batch) -> list[int]:
    return [int(i) for i in batch[..., 0].reshape(-1)]


def test_batch_shape_and_dtype(tmp_path):
    ds = TokenDataset(_make_index(tmp_path, [5, 6]), SEQ, global_batch=4, gradient_accumulation_steps=3)
    batch = next(ds)
    assert batch.shape == (3, 4, SEQ + 1) and batch.dtype == np.int32
    np.testing.assert_array_equal(batch[..., 1:], np.broadcast_to(np.arange(SEQ), (3, 4, SEQ)))


@pytest.mark.parametrize("window_files", [1, 2, 16])
def test_each_epoch_serves_every_record_once(tmp_path, window_files):
    counts = [5, 3, 7, 1]
    ds = TokenDataset(_make_index(tmp_path, counts), SEQ, global_batch=4, seed=3, window_files=window_files)
    rows = [i for _ in range(2 * sum(counts) // 4) for i in _ids(next(ds))]  # 2 epochs of 16 records
    everything = sorted(f * 100 + r for f, n in enumerate(counts) for r in range(n))
    assert sorted(rows[:16]) == everything and sorted(rows[16:]) == everything
    assert rows[:16] != rows[16:], "each epoch should shuffle differently"
    assert ds.state()["sources"][0] | {"index": None} == {"index": None, "epoch": 2, "position": 0}


def test_order_is_a_function_of_the_seed(tmp_path):
    index = _make_index(tmp_path, [6, 6, 6])
    first = [_ids(next(TokenDataset(index, SEQ, global_batch=18, seed=s))) for s in (1, 1, 2)]
    assert first[0] == first[1] and first[0] != first[2]


def test_count_in_name_and_counted_by_scan_agree(tmp_path):
    named = RecordFiles(_make_index(tmp_path / "a", [4, 2]), SEQ)
    scanned = RecordFiles(_make_index(tmp_path / "b", [4, 2], count_in_name=False), SEQ)
    assert named.counts_F.tolist() == scanned.counts_F.tolist() == [4, 2]
    assert [named.read(*named.locate(i))[0] for i in range(6)] == [scanned.read(*scanned.locate(i))[0]
                                                                  for i in range(6)]


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    index = _make_index(tmp_path, [5, 4, 6])
    kwargs = {"seq": SEQ, "global_batch": 4, "gradient_accumulation_steps": 2, "seed": 7, "window_files": 2}
    straight = TokenDataset(index, **kwargs)
    expected = [next(straight) for _ in range(6)]  # 48 rows: crosses three epochs of 15
    first = TokenDataset(index, **kwargs)
    for _ in range(2):
        next(first)
    state = json.loads(json.dumps(first.state()))
    assert state["sources"][0]["epoch"] == 1 and state["sources"][0]["position"] == 1

    resumed = TokenDataset(index, **kwargs, state=state)
    reads = []
    original_read = RecordFiles.read
    resumed.files[0].read = lambda f, r: reads.append((f, r)) or original_read(resumed.files[0], f, r)
    for want in expected[2:]:
        np.testing.assert_array_equal(next(resumed), want)
    assert len(reads) == 4 * 8, "resuming must read only the rows it serves, nothing consumed before"


def test_restore_moves_an_existing_dataset(tmp_path):
    index = _make_index(tmp_path, [3, 3])
    ds = TokenDataset(index, SEQ, global_batch=2, seed=1)
    state = ds.state()
    first = next(ds)
    next(ds)
    ds.restore(state)
    np.testing.assert_array_equal(next(ds), first)


@pytest.mark.parametrize("state", [{}, {"step": 0}, {"step": 0, "sources": []}, {"step": 0, "sources": [{}]}])
def test_restore_rejects_malformed_state(tmp_path, state):
    ds = TokenDataset(_make_index(tmp_path, [3]), SEQ, global_batch=1)
    with pytest.raises(ValueError, match="data state"):
        ds.restore(state)


def test_two_processes_together_equal_one_process(tmp_path):
    index = _make_index(tmp_path / "a", [5, 5])
    other = _make_index(tmp_path / "b", [4], source=1)
    for sources in (index, [(index, 0.6), (other, 0.4)]):
        kwargs = {"seq": SEQ, "global_batch": 6, "gradient_accumulation_steps": 2, "seed": 5}
        whole = TokenDataset(sources, **kwargs)
        parts = [TokenDataset(sources, **kwargs, process_index=p, process_count=2) for p in range(2)]
        for _ in range(4):
            halves = [next(p) for p in parts]
            assert halves[0].shape == (2, 3, SEQ + 1)
            np.testing.assert_array_equal(np.concatenate(halves, axis=1), next(whole))
        assert parts[0].state() == parts[1].state() == whole.state()


def test_resume_on_a_different_process_count(tmp_path):
    index = _make_index(tmp_path, [6, 6])
    single = TokenDataset(index, SEQ, global_batch=4, seed=2)
    next(single)
    state = single.state()
    expected = next(single)
    parts = [TokenDataset(index, SEQ, global_batch=4, seed=2, process_index=p, process_count=2, state=state)
             for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([next(p) for p in parts], axis=1), expected)


def test_mixture_follows_its_weights(tmp_path):
    heavy = _make_index(tmp_path / "heavy", [9, 8], source=0)
    light = _make_index(tmp_path / "light", [5], source=1)
    ds = TokenDataset([(heavy, 3.0), (light, 1.0)], SEQ, global_batch=500, gradient_accumulation_steps=4, seed=11)
    rows = np.array(_ids(next(ds)))
    n_light = int((rows >= 10_000).sum())
    expected, std = 2000 * 0.25, (2000 * 0.25 * 0.75) ** 0.5
    assert abs(n_light - expected) < 4 * std, n_light
    positions = [s["epoch"] * n + s["position"] for s, n in zip(ds.state()["sources"], (17, 5))]
    assert positions == [2000 - n_light, n_light], "each source advances by the rows it served"
    # Every source still serves each of its records once per epoch.
    light_rows = sorted(rows[rows >= 10_000][:5].tolist())
    assert light_rows == [10_000 + r for r in range(5)]


def test_relative_paths_resolve_against_the_index(tmp_path, monkeypatch):
    index = _make_index(tmp_path / "deep" / "set", [2])
    monkeypatch.chdir(tmp_path)
    assert data.read_index(index) == [str(tmp_path / "deep" / "set" / "part_0_2.tfrecords")]
    absolute = _make_index(tmp_path / "abs", [2], relative=False)
    assert data.read_index(absolute) == [str(tmp_path / "abs" / "part_0_2.tfrecords")]


def test_val_batches_are_sequential_and_split(tmp_path):
    index = _make_index(tmp_path, [3, 4])
    whole = list(val_batches(index, SEQ, global_batch=4, n_batches=5))
    assert [_ids(b) for b in whole] == [[0, 1, 2, 100]]  # 7 records hold one batch of 4; no repeats
    halves = [list(val_batches(index, SEQ, 4, 1, process_index=p, process_count=2)) for p in range(2)]
    assert [_ids(h[0]) for h in halves] == [[0, 1], [2, 100]]


def _expect_error(match: str, make) -> None:
    with pytest.raises(DataError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message and re.search(match, message), message


def test_empty_index_is_an_error(tmp_path):
    index = tmp_path / "empty.index"
    index.write_text("\n\n")
    _expect_error(f"{re.escape(str(index))} lists no record files", lambda: TokenDataset(str(index), SEQ, 1))


def test_missing_index_is_an_error(tmp_path):
    index = str(tmp_path / "nope.index")
    _expect_error(f"{re.escape(index)} does not exist", lambda: TokenDataset(index, SEQ, 1))


def test_index_listing_a_missing_file_is_an_error(tmp_path):
    index = tmp_path / "set.index"
    index.write_text("gone_0_5.tfrecords\n")
    _expect_error(f"{re.escape(str(tmp_path / 'gone_0_5.tfrecords'))}.*does not exist",
                  lambda: TokenDataset(str(index), SEQ, 1))


@pytest.mark.parametrize("name", ["empty.tfrecords", "empty_0_0.tfrecords"])
def test_empty_data_file_is_an_error(tmp_path, name):
    (tmp_path / name).write_bytes(b"")
    (tmp_path / "set.index").write_text(name + "\n")
    _expect_error(f"{re.escape(str(tmp_path / name))}.*holds no records",
                  lambda: TokenDataset(str(tmp_path / "set.index"), SEQ, 1))


def test_file_name_claiming_more_records_than_it_holds_is_an_error(tmp_path):
    index = _make_index(tmp_path, [3])
    os.rename(tmp_path / "part_0_3.tfrecords", tmp_path / "part_0_5.tfrecords")
    (tmp_path / "set.index").write_text("part_0_5.tfrecords\n")
    ds = TokenDataset(index, SEQ, global_batch=1)
    _expect_error("part_0_5.tfrecords: its name says 5 records but it holds 3", lambda: next(ds))


def test_record_of_the_wrong_length_names_the_file(tmp_path):
    index = _make_index(tmp_path, [2])
    ds = TokenDataset(index, SEQ + 1, global_batch=1)
    _expect_error(rf"{re.escape(str(tmp_path / 'part_0_2.tfrecords'))}: record at byte offset \d+ has 8 tokens",
                  lambda: next(ds))


def test_corrupt_record_names_file_and_offset(tmp_path):
    index = _make_index(tmp_path, [2])
    path = tmp_path / "part_0_2.tfrecords"
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0xFF  # inside the last record's data
    path.write_bytes(bytes(raw))
    ds = TokenDataset(index, SEQ, global_batch=2)
    _expect_error(rf"{re.escape(str(path))}: corrupt TFRecord at byte offset [1-9]\d*: data CRC", lambda: next(ds))
    assert ds.state()["step"] == 0, "a failed batch must not advance the state"


@pytest.fixture(scope="module")
def gcs_bucket():
    from tests.gcs_emulator import create_bucket, gcs_emulator

    with gcs_emulator() as url:
        create_bucket(url, "data-bucket")
        yield "gs://data-bucket"


def test_reads_gcs_like_local_files(tmp_path, gcs_bucket):
    from mesh_transformer import storage

    local = _make_index(tmp_path, [3, 4], count_in_name=False)
    names = (tmp_path / "set.index").read_text().split()
    for name in names:
        storage.write_bytes_atomic(f"{gcs_bucket}/set/{name}", (tmp_path / name).read_bytes())
    storage.write_bytes_atomic(f"{gcs_bucket}/set/set.index", "\n".join([*names, "gone.tfrecords"]).encode())
    _expect_error(r"gs://data-bucket/set/gone.tfrecords .*does not exist",
                  lambda: TokenDataset(f"{gcs_bucket}/set/set.index", SEQ, 1))
    storage.write_bytes_atomic(f"{gcs_bucket}/set/set.index", "\n".join(names).encode())
    remote = TokenDataset(f"{gcs_bucket}/set/set.index", SEQ, global_batch=7, seed=4)
    np.testing.assert_array_equal(next(remote), next(TokenDataset(local, SEQ, global_batch=7, seed=4)))
