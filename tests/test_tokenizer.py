"""Offline tokenizer loading: GPT-2's BPE from bundled files, or a local directory."""
import pytest

from mesh_transformer.tokenizer import EOS_ID, load_tokenizer


@pytest.mark.parametrize("name", [None, "gpt2"])
def test_gpt2_encodes_hello_world(name):
    tokenizer = load_tokenizer(name)
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == EOS_ID == 50256
    assert tokenizer.decode([15496, 995]) == "Hello world"


def test_local_directory_loads_its_tokenizer(tmp_path):
    load_tokenizer().save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).encode("Hello world") == [15496, 995]


def test_unknown_name_is_a_clear_error_and_downloads_nothing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="neither 'gpt2', a local directory"):
        load_tokenizer("no-such-org/no-such-tokenizer")


def test_gpt2_s_tokenizer_does_not_import_torch():
    """transformers' AutoTokenizer imports torch where it is installed (0.2 GB resident in every sampling and serving
    process); GPT-2's tokenizer needs none of it."""
    import subprocess
    import sys

    code = ("import sys; from mesh_transformer.tokenizer import load_tokenizer; load_tokenizer('gpt2'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_completion_ends_at_the_tokenizers_own_end_of_text():
    """Pythia's tokenizer ends text with id 0, GPT-2's with 50256: the tools stop where the tokenizer says."""
    from types import SimpleNamespace

    from mesh_transformer.tokenizer import eos_ids, load_tokenizer

    assert eos_ids(load_tokenizer()) == (50256,)
    assert eos_ids(SimpleNamespace(eos_token_id=0)) == (0,)
    assert eos_ids(SimpleNamespace(eos_token_id=None)) == () == eos_ids(object())
