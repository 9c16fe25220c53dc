import dataclasses
import json
import os
import socket
import subprocess
import sys

import numpy as np

from mesh_transformer.store import checkpoint
from mesh_transformer.train.trainer import Trainer

from tests.helpers import REPO_ROOT, make_config, train_losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one_and_their_checkpoint_restores_in_one(tmp_path):
    cfg = make_config(tmp_path, total_steps=5, ckpt_every=5, val_every=5, model_dir=str(tmp_path / "two"))
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    port = str(free_port())
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0"}
    procs = [subprocess.Popen([sys.executable, "device_train.py", "--config", str(cfg_path), "--coordinator",
                               f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(k)],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for k in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "stopped at step 5" in outputs[0] and "stopped at step 5" not in outputs[1]  # only process 0 reports

    single = dataclasses.replace(cfg, model_dir=str(tmp_path / "one"))
    Trainer(single).run()
    two, one = train_losses(cfg.model_dir), train_losses(single.model_dir)
    assert sorted(two) == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([two[s] for s in range(1, 6)], [one[s] for s in range(1, 6)], rtol=1e-5)

    resumed = Trainer(dataclasses.replace(cfg, total_steps=6))  # the 2-process checkpoint, in 1 process
    assert resumed.step == 5
    assert checkpoint.read_metadata(cfg.model_dir, 5)["data_state"] == resumed.dataset.state()
    ref = Trainer(dataclasses.replace(single, total_steps=6))
    for a, b in zip(np.asarray(resumed.state["params"]["lm_head"]["kernel"]),
                    np.asarray(ref.state["params"]["lm_head"]["kernel"])):
        np.testing.assert_allclose(a, b, atol=1e-5)
