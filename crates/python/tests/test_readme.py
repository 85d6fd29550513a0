"""The Python examples of the README and the book run as written.

Every ```python fenced block of the workspace's README.md, of crates/python/README.md (if there
is one) and of every chapter of the book (docs/src) is a test of its own, named after its file and the line of its opening fence.
The rules, kept simple on purpose:

- **Each block is a complete program.** It runs alone, in a fresh interpreter
  (``sys.executable``), in an empty temporary working directory, with a timeout; it passes when
  it exits with status 0, and a failure shows its stdout and stderr. Blocks do not share names:
  a block that continues an earlier one must repeat what it uses (the README's blocks do).
- **Nothing outside its directory.** A block that names an absolute path (a string literal
  starting with ``/``) fails before it runs: it would write outside its temporary directory
  (or fail for want of permission). Use a relative path.
- **Services "started elsewhere" are started for it.** A block that connects to a replay
  service or a store by name (``RemoteReplayBuffer("NAME", ...)``, ``Store("NAME")``), without
  serving that name itself (``ReplayServer("NAME", ...)``, ``Store.start("NAME")``), gets one
  started first in the same process (``tensordict_rs.ReplayServer``, ``Store.start``, as the
  README says one may), under a private runtime directory (``TDICT_RUNTIME_DIR``).
- **Optional dependencies are skipped, not failed.** A block that stops on
  ``ModuleNotFoundError`` for a module this interpreter cannot import (torch, torchrl, ray, ...)
  is skipped as "needs X"; a block that mentions ``cuda`` is skipped as "needs a GPU" unless
  torch is importable and sees one. A missing ``tensordict_rs`` or ``numpy`` (the package's
  test requirements) is a failure.
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
READMES = [ROOT / "README.md", ROOT / "crates" / "python" / "README.md", *sorted((ROOT / "docs" / "src").rglob("*.md"))]
TIMEOUT_S = 180
# What the package's tests require (pyproject's `test` extra, and the package itself).
REQUIRED = {"tensordict_rs", "numpy"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


def python_blocks(path):
    """(line of the opening fence, code) of every ```python block of a Markdown file."""
    blocks, lines = [], path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].split()
        start, body = i + 1, []
        i += 1
        while i < len(lines):
            close = FENCE.match(lines[i])
            if close and close["fence"].startswith(fence[0] * len(fence)) and not close["info"].strip():
                break
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        if info and info[0].lower() in ("python", "py", "python3"):
            blocks.append((start, "\n".join(body) + "\n"))
    return blocks


def collect():
    params = []
    for readme in READMES:
        if readme.exists():
            for line, code in python_blocks(readme):
                name = f"{readme.relative_to(ROOT)}:{line}"
                params.append(pytest.param(name, code, id=name))
    return params


def string_literals(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def call_name(node):
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        # `Store.start(...)` is "Store.start"; `tdr.Store(...)` is "Store".
        if func.attr == "start" and isinstance(func.value, (ast.Name, ast.Attribute)):
            inner = func.value.id if isinstance(func.value, ast.Name) else func.value.attr
            return f"{inner}.start"
        return func.attr
    return None


def named_services(tree):
    """{name: "replay" | "store"} of the services a block connects to by name and does not serve."""
    wanted, served = {}, set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        name, kind = first.value, call_name(node)
        if kind in ("ReplayServer", "ReplayServer.start", "Store.start"):
            served.add(name)
        elif kind in ("RemoteReplayBuffer", "Store") and not name.startswith(("tcp:", "uds:")):
            wanted[name] = "replay" if kind == "RemoteReplayBuffer" else "store"
    return {name: kind for name, kind in wanted.items() if name not in served}


def gpu_available():
    if importlib.util.find_spec("torch") is None:
        return False
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"],
        capture_output=True,
        timeout=TIMEOUT_S,
    )
    return probe.returncode == 0


def runner(services):
    """The program the subprocess runs: start the services, then the block as __main__."""
    lines = ["import runpy", "import tensordict_rs as _tdr", "_services = []"]
    for name, kind in sorted(services.items()):
        if kind == "replay":
            lines.append(f"_services.append(_tdr.ReplayServer({name!r}, 1024))")
        else:
            lines.append(f"_services.append(_tdr.Store.start({name!r}))")
    lines.append("runpy.run_path('readme_block.py', run_name='__main__')")
    return "\n".join(lines)


def as_text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def show(stdout, stderr):
    return f"--- stdout ---\n{as_text(stdout)}\n--- stderr ---\n{as_text(stderr)}"


@pytest.mark.parametrize("name, code", collect())
def test_readme_python_block_runs(name, code, tmp_path):
    tree = ast.parse(code, filename=name)  # a syntax error fails here, naming the block

    absolute = sorted({s for s in string_literals(tree) if re.match(r"/\w", s)})
    assert not absolute, (
        f"{name} names absolute paths {absolute}: it runs in a temporary directory and must leave "
        "nothing outside it; use relative paths"
    )
    if re.search(r"\bcuda\b", code) and not gpu_available():
        pytest.skip("needs a GPU (torch with CUDA)")

    work = tmp_path / "work"
    work.mkdir()
    (work / "readme_block.py").write_text(code, encoding="utf-8")
    env = dict(os.environ, TDICT_RUNTIME_DIR=str(tmp_path / "run"), PYTHONDONTWRITEBYTECODE="1")
    try:
        done = subprocess.run(
            [sys.executable, "-c", runner(named_services(tree))],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        done = e
    if isinstance(done, subprocess.TimeoutExpired):
        pytest.fail(f"{name} ran past {TIMEOUT_S} s\n{show(done.stdout, done.stderr)}", pytrace=False)

    if done.returncode != 0:
        for module in re.findall(r"No module named '([\w.]+)'", done.stderr):
            top = module.split(".")[0]
            if top not in REQUIRED and importlib.util.find_spec(top) is None:
                pytest.skip(f"needs {top}")
    assert done.returncode == 0, f"{name} exited with {done.returncode}\n{show(done.stdout, done.stderr)}"
