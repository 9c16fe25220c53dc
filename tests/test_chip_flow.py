"""bench/chip_flow.py's stage runner: when each stage's log first says what (the cold-start fields), what the
compilation cache did, and a server's stage ended once it is ready."""
import json
import sys

from bench import chip_flow

SERVER = """
import sys, time
print("inference mesh: dp 1 x mp 1 over 1 tpu devices", flush=True)
print("memory per device: 14.1 GiB of the 14.2 GiB allowed (...)", flush=True)
print("read 12.10 GB of params from ckpt in 7.5 s (joined on the devices)", flush=True)
print("compiled them in 3.0 s", flush=True)
print("compilation cache /c: 80 of 84 programs read from it (612.3 s of compiling saved)", flush=True)
print("serving gptj with 64 slots on http://127.0.0.1:0", flush=True)
time.sleep(600)  # a server: the stage ends it
"""


def test_a_stage_records_its_markers_and_ends_a_server_once_it_is_ready(tmp_path, capsys):
    rc, output = chip_flow.stage("serve_int8_cold", [sys.executable, "-c", SERVER], str(tmp_path / "serve.log"),
                                 until=chip_flow.MARKERS["ready_s"])
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rc == 0 and record["rc"] == 0 and "error" not in record
    assert record["runtime_s"] <= record["sized_s"] <= record["read_s"] <= record["compiled_s"] <= record["ready_s"]
    assert record["wall_s"] < 600 and "first_token_s" not in record
    assert (record["cache_hits"], record["cache_requests"], record["compile_saved_s"]) == (80, 84, 612.3)
    assert record["params_gb"] == 12.1 and record["load_s"] == 7.5
    assert output == (tmp_path / "serve.log").read_text()


def test_a_failed_stage_keeps_its_last_lines(tmp_path, capsys):
    rc, _ = chip_flow.stage("serve_refused", [sys.executable, "-c", "print('error: the server does not fit'); "
                                             "raise SystemExit(2)"], str(tmp_path / "refused.log"))
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert rc == 2 and record["error"] == ["error: the server does not fit"]


def test_a_random_hf_directory_of_a_models_shape_samples_through_device_sample(tmp_path, monkeypatch, capsys):
    """`--model`'s write stage: a random HF directory of a MODELS shape (here a tiny Llama with 2 query heads a key
    head), its tokenizer of the whole vocabulary, read back by device_sample.py --hf."""
    import subprocess

    from mesh_transformer import config
    from mesh_transformer.store import hf

    tiny = {**chip_flow.MODELS["llama3_8b"], "layers": 2, "d_model": 256, "n_heads": 4, "n_kv_heads": 2,
            "intermediate_size": 512, "n_vocab": 1000, "pe_rotary_dims": 64}
    monkeypatch.setitem(chip_flow.MODELS, "tiny_llama", tiny)
    path = str(tmp_path / "tiny_llama")
    chip_flow.write_random_hf(path, "tiny_llama", 64)
    record = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert record["stage"] == "write_hf_tiny_llama" and record["rc"] == 0
    cfg = hf.config_from_hf(json.load(open(f"{path}/config.json")))
    assert (cfg.family, cfg.kv_heads, cfg.d_ff, cfg.n_vocab, cfg.seq) == ("llama", 2, 512, 1000, 64)
    assert config.from_dict({**tiny, "seq": 64, "cores_per_replica": 1}).n_vocab == cfg.n_vocab
    sample = subprocess.run([sys.executable, "device_sample.py", "--hf", path, "--prompt", "w3 w4 w5",
                             "--max-new-tokens", "4", "--temperature", "0"], capture_output=True, text=True,
                            cwd=chip_flow.ROOT, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert sample.returncode == 0, sample.stderr[-2000:]
    words = sample.stdout.split()
    assert len(words) == 4 and all(w.startswith("w") for w in words)
