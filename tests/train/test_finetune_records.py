"""Fine-tune records: a small corpus becomes packed records the dataset reads, EOS between documents; the
create_finetune_tfrecords.py command line over it."""
import json
from collections import Counter

import numpy as np
import pytest

from mesh_transformer.store.tfrecord import DataError
from mesh_transformer.tokenizer import EOS_ID, load_tokenizer
from mesh_transformer.train.data import RecordFiles, TokenDataset
from mesh_transformer.train.finetune_records import PackOptions, create_finetune_tfrecords, pack_records
from tests.helpers import run_script

SEQ = 15
DOCS = [f"Document {i} talks about topic {i * 7}, at some length. " * (1 + i % 3) for i in range(12)]


def _corpus(folder) -> None:
    """DOCS[0] as a .txt file, the rest as .jsonl lines in a subfolder (sorted order: a.txt, then sub/b.jsonl)."""
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(DOCS[0])
    (folder / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[1:]) + "\n")
    (folder / "notes.md").write_text("not part of the corpus")


def _all_records(index: str) -> np.ndarray:
    files = RecordFiles(index, SEQ)
    return np.stack([files.read(*files.locate(i)) for i in range(files.n_records)])


def _expected_stream() -> list[int]:
    tokenizer = load_tokenizer()
    return [t for doc in DOCS for t in [*tokenizer.encode(doc), EOS_ID]]


def _create(input_path, name: str, output_dir, records_per_file: int = 100_000, normalize_with_ftfy: bool = False,
            **options) -> tuple[str, int]:
    """`create_finetune_tfrecords` as the command line calls it: GPT-2's tokenizer, records of SEQ + 1 tokens."""
    return create_finetune_tfrecords(str(input_path), name, str(output_dir), load_tokenizer(),
                                     PackOptions(seq=SEQ, **options), records_per_file=records_per_file,
                                     normalize_with_ftfy=normalize_with_ftfy)


def test_cli_preserving_order_packs_documents_with_eos_between(tmp_path):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    result = run_script("create_finetune_tfrecords.py", str(tmp_path / "in"), "demo", "--output-dir", str(out),
                        "--seq", str(SEQ), "--files-per", "4", "--preserve-data-order")
    assert result.returncode == 0, result.stderr[-3000:]
    stream = _expected_stream()
    n_records = len(stream) // (SEQ + 1)
    names = (out / "demo.index").read_text().split()
    assert names[0] == "demo_0_4.tfrecords" and len(names) == -(-n_records // 4)
    records = _all_records(str(out / "demo.index"))
    np.testing.assert_array_equal(records.reshape(-1), stream[:n_records * (SEQ + 1)])  # last partial dropped
    assert f"wrote {n_records} records" in result.stdout

    batch = next(TokenDataset(str(out / "demo.index"), SEQ, global_batch=2, seed=0))
    assert batch.shape == (1, 2, SEQ + 1)


def test_shuffled_repacks_keep_every_token_of_each_epoch(tmp_path):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    _, n_records = _create(tmp_path / "in", "mix", out, n_repack_epochs=2, seed=3)
    stream = _expected_stream()
    per_epoch = len(stream) // (SEQ + 1)
    assert n_records == 2 * per_epoch
    records = _all_records(str(out / "mix.index"))
    assert len(records) == 2 * per_epoch
    for epoch in range(2):  # a shuffle only moves documents: the same tokens, less a dropped tail
        tokens = Counter(records[epoch * per_epoch:(epoch + 1) * per_epoch].reshape(-1).tolist())
        assert not tokens - Counter(stream)
        assert (Counter(stream) - tokens).total() == len(stream) - per_epoch * (SEQ + 1)
    assert not np.array_equal(records[:per_epoch], records[per_epoch:]), "each repack epoch shuffles anew"


def test_min_unique_tokens_drops_repetitive_records():
    docs = [np.full(40, 5, np.int32), np.arange(40, dtype=np.int32)]
    options = PackOptions(seq=9, preserve_data_order=True, min_unique_tokens=3)
    records = np.concatenate(list(pack_records(docs, options)))
    assert len(records) == 4 and all(len(set(r.tolist())) >= 3 for r in records)


def test_ordered_repack_starts_with_the_last_epochs_leftover():
    docs = [np.arange(1, 24, dtype=np.int32)]
    first, second = pack_records(docs, PackOptions(seq=9, n_repack_epochs=2, preserve_data_order=True))
    np.testing.assert_array_equal(first.reshape(-1), np.arange(1, 21))
    np.testing.assert_array_equal(second.reshape(-1), [21, 22, 23, *range(1, 18)])


def test_zst_jsonl_input(tmp_path):
    import zstandard

    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    _create(tmp_path / "c.jsonl.zst", "z", tmp_path, preserve_data_order=True)
    stream = _expected_stream()
    np.testing.assert_array_equal(_all_records(str(tmp_path / "z.index")).reshape(-1),
                                  stream[:len(stream) // (SEQ + 1) * (SEQ + 1)])


def _data_error(input_path, output_dir, match: str) -> None:
    """The corpus at `input_path` is refused with a one-line DataError naming `match`."""
    with pytest.raises(DataError) as e:
        _create(input_path, "x", output_dir)
    assert match in str(e.value) and "\n" not in str(e.value), e.value


def test_missing_input_path(tmp_path):
    _data_error(tmp_path / "nope", tmp_path, "does not exist")


def test_empty_input(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    _data_error(tmp_path / "empty.txt", tmp_path, "no documents")


def test_input_too_small_for_one_record(tmp_path):
    (tmp_path / "tiny.txt").write_text("Hello world")
    _data_error(tmp_path / "tiny.txt", tmp_path, "holds 3 tokens")


def test_bad_jsonl_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    _data_error(tmp_path / "bad.jsonl", tmp_path, "bad.jsonl:2:")


def test_folder_without_corpus_files(tmp_path):
    (tmp_path / "notes.md").write_text("hi")
    _data_error(tmp_path, tmp_path, "no .txt/.jsonl/.zst files")


def test_cli_user_mistake_is_one_line_on_stderr_and_exit_2(tmp_path):
    result = run_script("create_finetune_tfrecords.py", str(tmp_path / "nope"), "x", "--output-dir", str(tmp_path))
    err = result.stderr
    assert result.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "does not exist" in err and "Traceback" not in err


def test_ftfy_normalizes_text(tmp_path):
    (tmp_path / "a.txt").write_text("The Mona Lisa doesn\u00e2\u20ac\u2122t have eyebrows. " * 8)
    (tmp_path / "b.txt").write_text("The Mona Lisa doesn't have eyebrows. " * 8)
    for name in ("a", "b"):
        _create(tmp_path / f"{name}.txt", name, tmp_path, preserve_data_order=True, normalize_with_ftfy=True)
    np.testing.assert_array_equal(_all_records(str(tmp_path / "a.index")), _all_records(str(tmp_path / "b.index")))
