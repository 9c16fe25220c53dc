"""A/B of a bench against a given commit: the commit's own copy of the bench script and this tree's, run in
alternating rounds in child processes on the same machine, so that a change can show it did not slow a bench down.

Each side runs its own tree's script (whatever that tree's API was), so any commit with the script can be the base.
The commit's files come from `git archive` into a temporary folder; nothing in this checkout changes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_commit(commit: str) -> str:
    """A folder holding `commit`'s files (made once per commit, under the temporary directory)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError:
        raise SystemExit(f"--ab: {commit!r} is not a commit of this repository") from None
    folder = os.path.join(tempfile.gettempdir(), f"mesh-transformer-ab-{sha[:12]}")
    if not os.path.isdir(folder):
        staging = tempfile.mkdtemp(prefix=f"{os.path.basename(folder)}.")
        archive = subprocess.run(["git", "archive", sha], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", staging], input=archive, check=True)
        os.replace(staging, folder)  # whole or not at all: a half-extracted tree is never taken for the commit
    return folder


def run_script(tree: str, script: str, args: list[str]) -> Iterator[dict]:
    """The JSON records a bench script of `tree` prints, run in its own process from that tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PYTHONPATH")}
    out = subprocess.run([sys.executable, os.path.join(tree, script), *args], cwd=tree, env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def ab_rounds(commit: str, script: str, args: list[str], rounds: int,
              pick: Callable[[dict], tuple | None]) -> dict[tuple, dict[str, list[float]]]:
    """Per key that `pick` returns (key, value) for: the values of `rounds` alternating runs of the commit's copy of
    `script` ("base") and this tree's ("new"), base first in odd rounds and second in even ones. Every record the
    children print is printed too, with its side and round."""
    base_tree = export_commit(commit)
    values: dict[tuple, dict[str, list[float]]] = {}
    for i in range(rounds):
        order = [("base", base_tree), ("new", ROOT)]
        for side, tree in order if i % 2 == 0 else order[::-1]:
            for record in run_script(tree, script, args):
                print(json.dumps({"ab_side": side, "ab_round": i, **record}), flush=True)
                if (picked := pick(record)) is not None:
                    key, value = picked
                    values.setdefault(key, {"base": [], "new": []})[side].append(value)
    return values

