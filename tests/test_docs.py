"""The commands the README and docs/*.md show still run as written: each python script named exists and accepts every
--flag of its command line (as its --help lists them), each `make` target is in the Makefile. The examples each
top-level script's --help ends with are held to the same rule."""
from __future__ import annotations

import glob
import json
import os
import re
import shlex
from typing import NamedTuple

import pytest

from tests.helpers import REPO_ROOT, run_script

PYTHONS = ("python", "python3", ".venv/bin/python")
OPERATOR_CHARS = set("();<>|&")  # a word of these alone is a shell operator: a separator or a redirection
REDIRECTIONS = ("<", ">", ">>", ">&", "&>", "<&")  # the word after one is a file
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")  # an environment variable before a command, or make's VAR=x
# An entry of --help's option list (its continuations sit deeper): its flag and the aliases after it ("--a A, --b A").
OPTION_LINE = re.compile(r"^  (?:-\w, )?(--[\w-]+(?: [A-Z_]+)?(?:, --[\w-]+(?: [A-Z_]+)?)*)")
EXAMPLES = "\nexamples:\n"  # what the top-level scripts' --help ends with
MAKE_TARGET = re.compile(r"^([^\s:=#][^:=#]*?)\s*:(?!=)")  # "name:" (not "name := value")


class Command(NamedTuple):
    """One command a doc shows: where (1-based line of its first line), what runs ("make" or a script path) and
    the words after it (make: its targets and variables; a script: its arguments)."""
    line: int
    program: str
    words: tuple[str, ...]


def code_lines(markdown: str) -> list[tuple[int, str]]:
    """(line number, text) of each line inside ``` fenced blocks, shell continuations (a trailing backslash)
    joined onto the line they start on."""
    lines, fenced = [], False
    for number, text in enumerate(markdown.splitlines(), 1):
        if text.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            lines.append((number, text))
    return joined(lines)


def joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Lines with shell continuations joined: a line ending in a backslash goes on with the next one, and the
    whole keeps the first one's number."""
    out: list[tuple[int, str]] = []
    parts: list[str] = []
    for number, text in lines:
        if not parts:
            first = number
        text = text.strip()
        parts.append(text.removesuffix("\\").strip())
        if not text.endswith("\\"):
            out.append((first, " ".join(parts)))
            parts = []
    return out + ([(first, " ".join(parts))] if parts else [])


def _words(text: str) -> list[str]:
    """A shell line's words as the shell splits them, a comment (a word starting with #) dropped and operators
    (&&, ;, |, <, ...) words of their own; an unbalanced quote gives the words between spaces before ' #'."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:
        return text.split(" #", 1)[0].split()


def commands(lines: list[tuple[int, str]]) -> list[Command]:
    """The python and make commands of these shell lines (comments dropped, commands split at && || ; | and the
    like, environment assignments before them skipped). python -c and python -m are not scripts: left out."""
    found = []
    for number, text in lines:
        text = text.strip()
        if text.startswith("$ "):  # a shell prompt
            text = text[2:]
        for part in _split(_words(text)):
            while part and ASSIGNMENT.match(part[0]):
                part = part[1:]
            if part and part[0] == "make":
                found.append(Command(number, "make", tuple(part[1:])))
            elif part and part[0] in PYTHONS:
                script = next((i for i, w in enumerate(part[1:], 1) if not w.startswith("-")), None)
                if script is None or any(w in ("-c", "-m") for w in part[1:script]):
                    continue
                found.append(Command(number, part[script], tuple(part[script + 1:])))
    return found


def _split(words: list[str]) -> list[list[str]]:
    """A command line's words split at the shell's command separators, redirections and their files dropped."""
    parts: list[list[str]] = [[]]
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in REDIRECTIONS:
            skip = True
        elif set(word) <= OPERATOR_CHARS:
            parts.append([])
        else:
            parts[-1].append(word)
    return [part for part in parts if part]


def flags_of(command: Command) -> list[str]:
    """The --flags of a script's arguments (up to a bare '--'), without their '=value' or a synopsis' brackets
    ('[--dtype bf16]')."""
    flags = []
    for word in command.words:
        word = word.lstrip("[").rstrip("]")
        if word == "--":
            break
        if word.startswith("--"):
            flags.append(word.split("=", 1)[0])
    return flags


def accepted_flags(help_text: str) -> set[str]:
    """The --flags a script's --help names: in its usage block and at the start of its option list's entries (not
    in its description or examples)."""
    help_text = help_text.split(EXAMPLES, 1)[0]
    usage = help_text.split("\n\n", 1)[0]
    options = [flag for m in map(OPTION_LINE.match, help_text.splitlines()) if m
               for flag in re.findall(r"--[\w-]+", m.group(1))]
    return set(re.findall(r"--[\w-]+", usage)) | set(options)


def make_targets(makefile: str) -> set[str]:
    """The targets a Makefile defines (rule lines "a b: prerequisites")."""
    targets = set()
    for line in makefile.splitlines():
        if not line.startswith("\t") and (m := MAKE_TARGET.match(line)):
            targets.update(m.group(1).split())
    return targets


def problems(where: str, found: list[Command], helps: dict[str, str], targets: set[str]) -> list[str]:
    """What does not hold of these commands, one line each, naming the file and line."""
    out = []
    for command in found:
        if command.program == "make":
            out += [f"{where}:{command.line}: make target '{word}' is not in the Makefile"
                    for word in command.words if not word.startswith("-") and not ASSIGNMENT.match(word)
                    and word not in targets]
        elif not os.path.isfile(os.path.join(REPO_ROOT, command.program)):
            out.append(f"{where}:{command.line}: script {command.program} does not exist")
        else:  # a script without --help here has no argument parser: it takes no flags
            accepted = accepted_flags(helps.get(command.program, ""))
            out += [f"{where}:{command.line}: {command.program} has no flag {flag}"
                    for flag in flags_of(command) if flag not in accepted]
    return out


# ---- the extractor itself

EXAMPLE_MD = """\
Train, then look:

```bash
make demo   # the whole demo
python device_train.py --config configs/demo.json \\
    --set lr=1e-3 --fresh-opt
XLA_FLAGS=--foo .venv/bin/python plot_metrics.py runs/a [--out a.png]  # --not-a-flag
python -m pytest -q tests
# python commented.py --gone
```

python outside.py --not-in-a-block
"""


def test_extractor_joins_continuations_and_drops_comments():
    found = commands(code_lines(EXAMPLE_MD))
    assert found == [Command(4, "make", ("demo",)),
                     Command(5, "device_train.py", ("--config", "configs/demo.json", "--set", "lr=1e-3",
                                                    "--fresh-opt")),
                     Command(7, "plot_metrics.py", ("runs/a", "[--out", "a.png]"))]
    assert flags_of(found[1]) == ["--config", "--set", "--fresh-opt"] and flags_of(found[2]) == ["--out"]


def test_extractor_splits_chained_commands_and_drops_redirections():
    lines = [(1, 'python a.py --x=1 < in.txt && make test PY=python3 | tee log; python3 b.py -- --not-ours')]
    found = commands(lines)
    assert found == [Command(1, "a.py", ("--x=1",)), Command(1, "make", ("test", "PY=python3")),
                     Command(1, "b.py", ("--", "--not-ours"))]
    assert flags_of(found[0]) == ["--x"] and flags_of(found[2]) == []


def test_accepted_flags_are_those_of_usage_and_option_list():
    help_text = ("usage: x.py [-h] [--out OUT]\n              [--long-one]\n\nWrites with --described-only.\n\n"
                 "options:\n  -h, --help  show this help\n  --out OUT   where; see --mentioned\n"
                 "  --long-one\n                the help, wrapped\n                --wrapped-mention\n\n"
                 "examples:\n  python x.py --out a\n  --example-only\n")
    assert accepted_flags(help_text) == {"--help", "--out", "--long-one"}


def test_problems_name_the_file_line_and_flag():
    helps = {"plot_metrics.py": "usage: plot_metrics.py [-h] [--out OUT] model_dir\n\noptions:\n"
                                "  -h, --help  show this help\n  --out OUT   the PNG\n"}
    found = [Command(3, "plot_metrics.py", ("runs/a", "--outt", "a.png")), Command(4, "make", ("tset",)),
             Command(5, "no_such_script.py", ())]
    assert problems("README.md", found, helps, {"test"}) == [
        "README.md:3: plot_metrics.py has no flag --outt",
        "README.md:4: make target 'tset' is not in the Makefile",
        "README.md:5: script no_such_script.py does not exist"]


# ---- the repository's docs and scripts

def _docs() -> list[str]:
    """README.md and docs/*.md (the folder may not exist), relative to the repository root."""
    paths = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO_ROOT))]
    return [p for p in paths if os.path.isfile(os.path.join(REPO_ROOT, p))]


def _read(path: str) -> str:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        return f.read()


TOP_LEVEL_SCRIPTS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO_ROOT, "*.py")))


@pytest.fixture(scope="module")
def doc_commands() -> dict[str, list[Command]]:
    return {path: commands(code_lines(_read(path))) for path in _docs()}


def _has_parser(script: str) -> bool:
    """Whether a script parses its command line with argparse (one without runs, whatever its arguments)."""
    return os.path.isfile(os.path.join(REPO_ROOT, script)) and "Parser(" in _read(script)


@pytest.fixture(scope="module")
def helps(doc_commands) -> dict[str, str]:
    """Each script's --help, for the top-level scripts and each script with a parser that a doc runs with flags,
    all in one child interpreter (tests/help_driver.py): a fresh one each is mostly importing JAX and torch again."""
    flagged = {c.program for found in doc_commands.values() for c in found if c.program != "make" and flags_of(c)}
    scripts = sorted(set(TOP_LEVEL_SCRIPTS) | {s for s in flagged if _has_parser(s)})
    driver = run_script(os.path.join("tests", "help_driver.py"), *scripts)
    assert driver.returncode == 0, driver.stderr[-2000:]
    results = json.loads(driver.stdout)
    for script in scripts:
        assert results[script]["returncode"] == 0, f"{script} --help failed: {results[script]['stderr'][-2000:]}"
    return {script: results[script]["stdout"] for script in scripts}


def test_docs_commands_name_real_scripts_flags_and_targets(doc_commands, helps):
    targets = make_targets(_read("Makefile"))
    found = [p for path, cmds in doc_commands.items() for p in problems(path, cmds, helps, targets)]
    assert not found, "commands in the docs that would not run as written:\n" + "\n".join(found)


def test_script_help_ends_with_examples_that_parse(helps):
    found = []
    for script in TOP_LEVEL_SCRIPTS:
        text = helps[script]
        examples = text.split(EXAMPLES, 1)[1] if EXAMPLES in text else ""
        cmds = commands(joined(list(enumerate(examples.splitlines(), 1))))
        if not [c for c in cmds if c.program == script]:
            found.append(f"{script} --help: no example that runs {script}")
        found += problems(f"{script} --help examples", cmds, helps, set())
    assert not found, "\n".join(found)
