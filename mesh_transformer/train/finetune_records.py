"""Text corpus -> tokenized, packed TFRecord files and an index: the library side of create_finetune_tfrecords.py.

Like the original tool: every document is tokenized and followed by EOS, documents are concatenated (shuffled unless
the order is to be kept) and cut into records of seq + 1 tokens, the last partial record dropped. Repack epochs
repeat the corpus with a different shuffle, so records straddle different document boundaries each time.
"""
from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from mesh_transformer import storage
from mesh_transformer.train.data import TOKENS_FEATURE
from mesh_transformer.store.tfrecord import DataError, encode_example, write_records

logger = logging.getLogger(__name__)

INPUT_SUFFIXES = (".txt", ".jsonl", ".zst")
_TOKENIZE_BATCH_DOCS = 256  # documents per call, so the Rust tokenizer can work on many at once


@dataclass(frozen=True)
class PackOptions:
    """How documents become records."""

    seq: int = 2048
    n_repack_epochs: int = 1
    seed: int = 10
    preserve_data_order: bool = False
    min_unique_tokens: int = 0


def list_input_files(input_path: str) -> list[str]:
    """The corpus files of a path: the file itself, or every .txt/.jsonl/.zst file below a folder, sorted."""
    if not storage.exists(input_path):
        raise DataError(f"input path {input_path} does not exist")
    if storage.is_gcs(input_path):
        is_folder = any(True for _ in storage.walk_files(input_path))
    else:
        is_folder = os.path.isdir(input_path)
    if is_folder:
        files = sorted(p for p in storage.walk_files(input_path) if p.endswith(INPUT_SUFFIXES))
        if not files:
            raise DataError(f"no {'/'.join(INPUT_SUFFIXES)} files under {input_path}")
        return files
    if not input_path.endswith(INPUT_SUFFIXES):
        raise DataError(f"input file {input_path} is not one of {'/'.join(INPUT_SUFFIXES)}")
    return [input_path]


def _open_text(path: str) -> io.TextIOBase:
    raw = storage.open_file(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise DataError(f"reading {path} needs the 'zstandard' package: pip install zstandard") from e
        raw = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
    return io.TextIOWrapper(raw, encoding="utf-8")


def read_documents(path: str) -> Iterator[str]:
    """The documents of one corpus file: a .txt file is one document, a .jsonl line's "text" field is one."""
    is_txt = path.removesuffix(".zst").endswith(".txt")
    with _open_text(path) as f:
        try:
            if is_txt:
                yield f.read()
                return
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: not valid JSON ({e})") from e
                if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                    raise DataError(f"{path}:{line_no}: a jsonl line must be an object with a string 'text' field")
                yield record["text"]
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e})") from e


def ftfy_normalizer() -> Callable[[str], str]:
    """ftfy's text fixer with NFKC normalization, as the original tool applied it."""
    try:
        import ftfy
    except ImportError as e:
        raise DataError("--normalize-with-ftfy needs the 'ftfy' package: pip install ftfy") from e
    return lambda text: ftfy.fix_text(text, normalization="NFKC")


def tokenize_documents(files: Sequence[str], tokenizer, normalize: Callable[[str], str] | None = None
                       ) -> list[np.ndarray]:
    """Every non-empty document as int32 token ids [N_doc] followed by EOS, in file order."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError("the tokenizer has no EOS token to put between documents")
    docs: list[np.ndarray] = []

    def flush(texts: list[str]) -> None:
        for ids in tokenizer(texts)["input_ids"]:
            docs.append(np.asarray([*ids, eos_id], np.int32))
        texts.clear()

    pending: list[str] = []
    for path in tqdm(files, desc="tokenizing", unit="file", disable=None):
        for text in read_documents(path):
            if text:
                pending.append(normalize(text) if normalize else text)
            if len(pending) >= _TOKENIZE_BATCH_DOCS:
                flush(pending)
    if pending:
        flush(pending)
    return docs


def _min_unique_mask(records_NT: np.ndarray, min_unique_tokens: int) -> np.ndarray:
    sorted_NT = np.sort(records_NT, axis=1)
    unique_N = 1 + np.count_nonzero(np.diff(sorted_NT, axis=1), axis=1)
    return unique_N >= min_unique_tokens


def pack_records(docs: Sequence[np.ndarray], options: PackOptions) -> Iterator[np.ndarray]:
    """Records [N, seq + 1] int32, one array per repack epoch; raises if the corpus is too small for one record."""
    if not docs:
        raise DataError("the input holds no documents")
    rng = np.random.default_rng(options.seed)
    record_tokens = options.seq + 1
    total_tokens = sum(len(d) for d in docs)
    if total_tokens < record_tokens:
        raise DataError(f"the input holds {total_tokens} tokens; one record needs seq + 1 = {record_tokens}")
    trailing_T = np.zeros(0, np.int32)
    for epoch in range(options.n_repack_epochs):
        if options.preserve_data_order:
            # Keeping order, a repack still shifts record boundaries: the last epoch's leftover tokens lead.
            stream_T = np.concatenate([trailing_T, *docs])
        else:
            stream_T = np.concatenate([docs[i] for i in rng.permutation(len(docs))])
        n_records = len(stream_T) // record_tokens
        records_NT = stream_T[:n_records * record_tokens].reshape(n_records, record_tokens)
        trailing_T = stream_T[n_records * record_tokens:]
        if options.min_unique_tokens > 0:
            keep_N = _min_unique_mask(records_NT, options.min_unique_tokens)
            logger.info("repack epoch %d: dropped %d of %d records with fewer than %d unique tokens", epoch,
                        int((~keep_N).sum()), n_records, options.min_unique_tokens)
            records_NT = records_NT[keep_N]
        if not options.preserve_data_order:
            records_NT = records_NT[rng.permutation(len(records_NT))]
        yield records_NT
    logger.info("dropped %d tokens of trailing data", len(trailing_T))


def write_record_files(record_batches: Iterator[np.ndarray], output_dir: str, name: str, records_per_file: int
                       ) -> tuple[str, int]:
    """Write records to `{name}_{i}_{n}.tfrecords` files, then the index `{name}.index`; returns (index, count)."""
    if records_per_file <= 0:
        raise DataError(f"records per file must be positive, got {records_per_file}")
    file_names: list[str] = []
    pending: list[np.ndarray] = []
    total = 0

    def flush() -> None:
        file_name = f"{name}_{len(file_names)}_{len(pending)}.tfrecords"
        write_records(storage.join(output_dir, file_name), (encode_example({TOKENS_FEATURE: r}) for r in pending))
        file_names.append(file_name)
        pending.clear()

    for records_NT in record_batches:
        for record_T in records_NT:
            pending.append(record_T)
            total += 1
            if len(pending) == records_per_file:
                flush()
    if pending:
        flush()
    if total == 0:
        raise DataError("no records left to write (all dropped by --min-unique-tokens?)")
    index_path = storage.join(output_dir, f"{name}.index")
    # Names relative to the index, so the folder can be moved or uploaded whole; written last, so it lists only
    # complete files.
    storage.write_bytes_atomic(index_path, "".join(f"{n}\n" for n in file_names).encode())
    return index_path, total


def create_finetune_tfrecords(input_path: str, name: str, output_dir: str, tokenizer, options: PackOptions,
                              records_per_file: int = 100_000, normalize_with_ftfy: bool = False) -> tuple[str, int]:
    """Tokenize a corpus and write it as packed TFRecord files with an index; returns (index path, record count)."""
    normalize = ftfy_normalizer() if normalize_with_ftfy else None
    files = list_input_files(input_path)
    docs = tokenize_documents(files, tokenizer, normalize)
    logger.info("%d documents, %d tokens from %d files", len(docs), sum(len(d) for d in docs), len(files))
    return write_record_files(pack_records(docs, options), output_dir, name, records_per_file)
