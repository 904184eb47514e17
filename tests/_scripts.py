"""Helpers of the script tests: import ``scripts/<name>.py`` by path, read a markdown table, run git."""

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """The module of ``scripts/<name>.py``, imported once and registered in ``sys.modules``."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up there
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def table(text: str) -> tuple[str, dict[str, list[str]]]:
    """The first markdown table of ``text``: its header line and ``{first cell: other cells}``."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    return rows[0], {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows[2:]}


def git(repo, *args: str) -> str:
    """``git -C repo args`` with a fixed author; its stdout, stripped (CalledProcessError on failure)."""
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()
