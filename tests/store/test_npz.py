""".npz members read from where np.savez left them: the arrays np.load gives, into given memory, by threads at once;
a compressed file through zipfile; a damaged member is a CRC error naming it."""
import zipfile
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from mesh_transformer.store import npz

RNG = np.random.default_rng(0)
ARRAYS = [RNG.normal(size=(33, 17)).astype(np.float32),
          RNG.normal(size=(8, 5)).astype(ml_dtypes.bfloat16).view("V2"),  # as numpy saved jax's bfloat16
          np.int32(383500), np.zeros((0, 4), np.float32), RNG.integers(0, 2, 300).astype(bool),
          np.asfortranarray(RNG.normal(size=(6, 7)))]


def _saved(tmp_path, compressed: bool = False) -> str:
    path = str(tmp_path / ("c.npz" if compressed else "f.npz"))
    (np.savez_compressed if compressed else np.savez)(path, *ARRAYS)
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_members_read_equal_what_numpy_loads(tmp_path, compressed):
    path = _saved(tmp_path, compressed)
    archive = npz.Archive(path)
    with np.load(path) as expected:
        assert archive.names() == [f"{key}.npy" for key in expected]
        for i in range(len(ARRAYS)):
            got, want = archive.read(f"arr_{i}.npy"), expected[f"arr_{i}"]
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.view(np.uint8) if got.dtype == "V2" else got,
                                          want.view(np.uint8) if want.dtype == "V2" else want)
    assert archive.member("arr_0.npy").direct != compressed and not archive.member("arr_5.npy").direct  # Fortran
    archive.close()


def test_a_member_is_read_into_given_memory(tmp_path):
    archive = npz.Archive(_saved(tmp_path))
    out = np.empty((2, 33, 17), np.float32)
    assert archive.read("arr_0.npy", out[1]) is not None
    np.testing.assert_array_equal(out[1], ARRAYS[0])
    archive.close()


def test_threads_read_members_of_one_file_at_once(tmp_path):
    arrays = [RNG.normal(size=(64, 64)).astype(np.float32) for _ in range(32)]
    path = str(tmp_path / "many.npz")
    np.savez(path, *arrays)
    archive = npz.Archive(path)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: archive.read(f"arr_{i}.npy"), [i % 32 for i in range(256)]))
    for i, array in enumerate(got):
        np.testing.assert_array_equal(array, arrays[i % 32])
    archive.close()


def test_a_damaged_member_is_a_crc_error_naming_it(tmp_path):
    path = _saved(tmp_path)
    archive = npz.Archive(path)
    offset = archive.member("arr_0.npy").data_offset + 100
    archive.close()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    archive = npz.Archive(path)
    with pytest.raises(zipfile.BadZipFile, match="f.npz:arr_0.npy"):
        archive.read("arr_0.npy")
    np.testing.assert_array_equal(archive.read("arr_2.npy"), ARRAYS[2])
    archive.close()
