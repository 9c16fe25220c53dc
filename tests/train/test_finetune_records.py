"""create_finetune_tfrecords: a small corpus becomes packed records the dataset reads, EOS between documents."""
import json
from collections import Counter

import numpy as np

import create_finetune_tfrecords as cli
from mesh_transformer.train.data import RecordFiles, TokenDataset
from mesh_transformer.train.finetune_records import PackOptions, pack_records
from mesh_transformer.tokenizer import EOS_ID, load_tokenizer

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


def test_cli_preserving_order_packs_documents_with_eos_between(tmp_path, capsys):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert cli.main([str(tmp_path / "in"), "demo", "--output-dir", str(out), "--seq", str(SEQ), "--files-per", "4",
                     "--preserve-data-order"]) == 0
    stream = _expected_stream()
    n_records = len(stream) // (SEQ + 1)
    names = (out / "demo.index").read_text().split()
    assert names[0] == "demo_0_4.tfrecords" and len(names) == -(-n_records // 4)
    records = _all_records(str(out / "demo.index"))
    np.testing.assert_array_equal(records.reshape(-1), stream[:n_records * (SEQ + 1)])  # last partial dropped
    assert f"wrote {n_records} records" in capsys.readouterr().out

    batch = next(TokenDataset(str(out / "demo.index"), SEQ, global_batch=2, seed=0))
    assert batch.shape == (1, 2, SEQ + 1)


def test_cli_shuffled_repacks_keep_every_token_of_each_epoch(tmp_path):
    _corpus(tmp_path / "in")
    out = tmp_path / "out"
    assert cli.main([str(tmp_path / "in"), "mix", "--output-dir", str(out), "--seq", str(SEQ),
                     "--n-repack-epochs", "2", "--seed", "3"]) == 0
    stream = _expected_stream()
    per_epoch = len(stream) // (SEQ + 1)
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
    assert cli.main([str(tmp_path / "c.jsonl.zst"), "z", "--output-dir", str(tmp_path), "--seq", str(SEQ),
                     "--preserve-data-order"]) == 0
    stream = _expected_stream()
    np.testing.assert_array_equal(_all_records(str(tmp_path / "z.index")).reshape(-1),
                                  stream[:len(stream) // (SEQ + 1) * (SEQ + 1)])


def _one_line_error(capsys, argv, match):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err and "Traceback" not in err, err


def test_missing_input_path(tmp_path, capsys):
    _one_line_error(capsys, [str(tmp_path / "nope"), "x", "--output-dir", str(tmp_path)], "does not exist")


def test_empty_input(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    _one_line_error(capsys, [str(tmp_path / "empty.txt"), "x", "--output-dir", str(tmp_path)], "no documents")


def test_input_too_small_for_one_record(tmp_path, capsys):
    (tmp_path / "tiny.txt").write_text("Hello world")
    _one_line_error(capsys, [str(tmp_path / "tiny.txt"), "x", "--output-dir", str(tmp_path)], "holds 3 tokens")


def test_bad_jsonl_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    _one_line_error(capsys, [str(tmp_path / "bad.jsonl"), "x", "--output-dir", str(tmp_path)], "bad.jsonl:2:")


def test_folder_without_corpus_files(tmp_path, capsys):
    (tmp_path / "notes.md").write_text("hi")
    _one_line_error(capsys, [str(tmp_path), "x", "--output-dir", str(tmp_path)], "no .txt/.jsonl/.zst files")


def test_ftfy_flag_normalizes_text(tmp_path):
    (tmp_path / "a.txt").write_text("The Mona Lisa doesn\u00e2\u20ac\u2122t have eyebrows. " * 8)
    (tmp_path / "b.txt").write_text("The Mona Lisa doesn't have eyebrows. " * 8)
    for name in ("a", "b"):
        assert cli.main([str(tmp_path / f"{name}.txt"), name, "--output-dir", str(tmp_path), "--seq", str(SEQ),
                         "--preserve-data-order", "--normalize-with-ftfy"]) == 0
    np.testing.assert_array_equal(_all_records(str(tmp_path / "a.index")), _all_records(str(tmp_path / "b.index")))
