"""Helpers shared by tests of several subpackages."""
from __future__ import annotations

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    """Runs one of the top-level command-line scripts as a user would, from the repository root."""
    return subprocess.run([sys.executable, script, *args], cwd=REPO_ROOT, input=stdin, capture_output=True,
                          text=True)
