"""A/B of a bench against a given commit: the commit's own copy of the bench script and this tree's, run in
alternating rounds in child processes on the same machine, so that a change can show it did not slow a bench down.

    python bench/ab.py COMMIT bench/bench_model.py [--rounds 2] [-- the bench's own flags]

prints every child record (with its side and round), then per record kind and throughput figure (each `*_per_s`
field) the per-round new/base ratios and their median. A bench's rows for the reference implementation (HF torch)
are its control for the machine's state.

Each side runs its own tree's script (whatever that tree's API was), so any commit with the script can be the base.
The commit's files come from `git archive` into a temporary folder; nothing in this checkout changes.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator

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
              pick: Callable[[dict], Iterable[tuple[tuple, float]]]) -> dict[tuple, dict[str, list[float]]]:
    """Per key that `pick` yields (key, value) pairs for: the values of `rounds` alternating runs of the commit's
    copy of `script` ("base") and this tree's ("new"), base first in odd rounds and second in even ones. Every record
    the children print is printed too, with its side and round."""
    base_tree = export_commit(commit)
    values: dict[tuple, dict[str, list[float]]] = {}
    for i in range(rounds):
        order = [("base", base_tree), ("new", ROOT)]
        for side, tree in order if i % 2 == 0 else order[::-1]:
            for record in run_script(tree, script, args):
                print(json.dumps({"ab_side": side, "ab_round": i, **record}), flush=True)
                for key, value in pick(record):
                    values.setdefault(key, {"base": [], "new": []})[side].append(value)
    return values


def median_ratios(values: dict[tuple, dict[str, list[float]]]) -> Iterator[tuple[tuple, list[float], float]]:
    """(key, per-round new/base ratios, their median) of `ab_rounds`' values."""
    for key, sides in values.items():
        ratios = [new / base for base, new in zip(sides["base"], sides["new"])]
        if ratios:
            yield key, ratios, statistics.median(ratios)


# Fields that name what a record measures (the rest are its measurements).
_KEY_FIELDS = ("bench", "impl", "variant", "name", "batch", "mode", "phase", "concurrency", "kind")


def throughputs(record: dict) -> Iterator[tuple[tuple, float]]:
    """(key, value) of every `*_per_s` figure of a record, the key naming the record kind and the figure."""
    kind = tuple((k, record[k]) for k in _KEY_FIELDS if k in record)
    for field, value in record.items():
        if field.endswith("_per_s") and isinstance(value, (int, float)) and value > 0:
            yield (*kind, ("figure", field)), float(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit")
    parser.add_argument("script", help="the bench script, relative to the repository root")
    parser.add_argument("--rounds", type=int, default=2)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, bench_args = parser.parse_args(argv[:cut]), argv[cut + 1:]  # after --: the bench's own flags
    values = ab_rounds(args.commit, args.script, bench_args, args.rounds, throughputs)
    for key, ratios, median in median_ratios(values):
        sides = values[key]
        print(json.dumps({"bench": "ab", "script": args.script, "base": args.commit, **dict(key),
                          "base_values": sides["base"], "new_values": sides["new"],
                          "new_over_base": [round(r, 3) for r in ratios], "median_new_over_base": round(median, 3)}),
              flush=True)


if __name__ == "__main__":
    main()
