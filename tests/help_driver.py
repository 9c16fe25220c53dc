"""Runs `SCRIPT --help` for each script named on the command line, one after another in this one interpreter, as
`python SCRIPT --help` would from the repository root (the script run as __main__, its folder first on sys.path),
and prints one JSON object: {script: {"returncode", "stdout", "stderr"}}.

The docs tests read every script's --help; most of a fresh interpreter's run of one is importing JAX, torch and
transformers, which here happens once for all of them."""
import contextlib
import io
import json
import os
import runpy
import sys
import traceback

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def help_of(script: str) -> dict:
    out, err = io.StringIO(), io.StringIO()
    path = os.path.join(REPO_ROOT, script)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0] = [path, "--help"], os.path.dirname(path)
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if isinstance(stop.code, str):
            err.write(stop.code + "\n")
    except Exception:  # reported as the failed run a fresh interpreter would have had
        code = 1
        err.write(traceback.format_exc())
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


if __name__ == "__main__":
    os.chdir(REPO_ROOT)
    results = {script: help_of(script) for script in sys.argv[1:]}
    sys.stdout.write(json.dumps(results))
