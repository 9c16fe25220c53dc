"""Runs device_train.main in a child process; can stall one checkpoint write just before its commit.

With STALL_CHECKPOINT_STEP=N and STALL_MARKER=path, the writer of step N writes every piece and index, then creates
the marker file and blocks forever, so the test can SIGKILL the process in the middle of that checkpoint.
"""
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mesh_transformer.store import checkpoint_format

if os.environ.get("STALL_CHECKPOINT_STEP"):
    stall_step = int(os.environ["STALL_CHECKPOINT_STEP"])
    write_index = checkpoint_format.write_index

    def stalled_write_index(directory, step, *args, **kwargs):
        write_index(directory, step, *args, **kwargs)
        if step == stall_step:
            open(os.environ["STALL_MARKER"], "w").close()
            threading.Event().wait()

    checkpoint_format.write_index = stalled_write_index

import device_train

sys.exit(device_train.main(sys.argv[1:]))
