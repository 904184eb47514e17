"""The two sides of a comparison: git refs, temporary worktrees, flags, configs.

A side is a git ref (checked out with ``git worktree add --detach`` into a temporary
folder), extra ``run_train.sh`` flags, or both; a side with neither is the working
tree of ``--repo``. :func:`resolve_sides` resolves both sides of parsed CLI arguments,
:func:`validate_sides` checks their flags with the trainer's own config parser, and
:func:`run_cli` runs a tool's body with the shared error handling and removes the
worktrees again.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from graph_trainer.config import CONFIG_NAMES

# Where CONFIG_NAMES' files live in a side's tree (relative: a ref side runs its own copy).
CONFIG_DIR = "train_configs"
DEFAULT_CONFIG = f"{CONFIG_DIR}/debug_model.toml"
# Flags this tool sets itself; a user value would be silently overridden.
OWNED_FLAGS = {
    "--training.steps": "--steps",
    "--job.dump_folder": "--out",
    "--metrics.log_freq": "(always 1)",
}


class CompareError(Exception):
    """Bad input, found before any run starts (exit code 2)."""


@dataclass
class Side:
    """One side of a comparison, resolved by :func:`resolve_sides`."""

    name: str  # "A" or "B"
    ref: str | None
    flags: list[str]
    label: str = ""
    commit: str | None = None
    root: str = ""  # the tree it runs from
    worktree: bool = False
    config_file: str = ""  # as passed to run_train.sh (relative to root, or absolute)
    config_note: str = ""
    dirty: list[str] = field(default_factory=list)  # working-tree sides: uncommitted paths

    def describe(self) -> dict:
        """The side as recorded in the tools' JSON output."""
        d = {
            "label": self.label, "ref": self.ref, "commit": self.commit, "flags": self.flags,
            "tree": self.root, "worktree": self.worktree, "config_file": self.config_file,
        }
        if not self.worktree:
            d["uncommitted_changes"] = self.dirty
        return d


def _git(repo: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``git -C repo args`` with its output captured."""
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=check)


def default_repo() -> str:
    """The tree holding this package's run_train.sh, else the git top level of the cwd."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(here, "run_train.sh")):
        return here
    r = _git(os.getcwd(), "rev-parse", "--show-toplevel", check=False)
    return r.stdout.strip() if r.returncode == 0 else os.getcwd()


def resolve_ref(repo: str, ref: str) -> str:
    """Full commit sha of ``ref``. Raises CompareError for unknown refs / no git repo."""
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if r.returncode != 0 or not r.stdout.strip():
        inside = _git(repo, "rev-parse", "--git-dir", check=False).returncode == 0
        if not inside:
            raise CompareError(f"--repo {repo} is not a git repository, so ref '{ref}' cannot be checked out.")
        raise CompareError(
            f"unknown git ref '{ref}' in {repo} (git rev-parse --verify '{ref}^{{commit}}' failed). "
            f"Check the branch/tag/sha; `git fetch` if it is a remote branch."
        )
    return r.stdout.strip()


def dirty_paths(repo: str) -> list[str]:
    """Uncommitted changes of the working tree (tracked changes and untracked files)."""
    r = _git(repo, "status", "--porcelain", "--untracked-files=normal", check=False)
    if r.returncode != 0:
        return []
    return [line[3:] for line in r.stdout.splitlines() if line.strip()]


def check_owned_flags(flags: list[str], where: str) -> None:
    """Raise CompareError if ``flags`` set one of :data:`OWNED_FLAGS` (``where`` names them)."""
    for f in flags:
        key = f.split("=", 1)[0]
        if key in OWNED_FLAGS:
            raise CompareError(
                f"{where} sets {key}, which this tool sets for every run; use {OWNED_FLAGS[key]} instead."
            )


def resolve_config(cli_value: str | None, env: dict) -> tuple[str, str]:
    """(config path as given, where it came from): ``cli_value`` (``--config-file``), else
    ``CONFIG_FILE``, else ``CONFIG`` (a name in :data:`graph_trainer.config.CONFIG_NAMES`,
    the file taken from the side's ``train_configs/``), else :data:`DEFAULT_CONFIG`.
    Raises CompareError for unknown CONFIG names."""
    if cli_value:
        return cli_value, "--config-file"
    if env.get("CONFIG_FILE"):
        return env["CONFIG_FILE"], "CONFIG_FILE"
    if env.get("CONFIG"):
        name = env["CONFIG"]
        if name not in CONFIG_NAMES:
            raise CompareError(
                f"CONFIG={name} is not a known config name ({', '.join(sorted(CONFIG_NAMES))}); "
                f"or set CONFIG_FILE / --config-file to a TOML file."
            )
        return f"{CONFIG_DIR}/{CONFIG_NAMES[name]}", f"CONFIG={name}"
    return DEFAULT_CONFIG, "default"


def config_for_side(config: str, side: Side) -> None:
    """Set ``side.config_file``: relative paths from the side's tree when there, else the cwd."""
    if os.path.isabs(config):
        if not os.path.isfile(config):
            raise CompareError(f"config file '{config}' does not exist.")
        side.config_file, side.config_note = config, "absolute path"
        return
    if os.path.isfile(os.path.join(side.root, config)):
        side.config_file, side.config_note = config, "from the side's tree"
        return
    if os.path.isfile(config):
        side.config_file, side.config_note = os.path.abspath(config), "not in the side's tree; from the current directory"
        return
    raise CompareError(
        f"config file '{config}' exists neither in side {side.name}'s tree ({side.root}) nor in the current directory."
    )


def validate_flags(side: Side, extra: list[str], steps: int, dump: str) -> str | None:
    """Run the trainer's own config check in the side's tree; the error text or None."""
    cmd = ["python3", "-m", "graph_trainer.config", "--job.config_file", side.config_file,
           *side.flags, *extra, *forced_flags(steps, dump)]
    env = child_env(side)
    r = subprocess.run(cmd, cwd=side.root, env=env, capture_output=True, text=True)
    if r.returncode == 0:
        return None
    text = "\n".join(l for l in (r.stderr + r.stdout).splitlines() if "HF assets path" not in l)
    return text.strip() or f"exit code {r.returncode}"


def forced_flags(steps: int, dump: str) -> list[str]:
    """The run_train.sh flags this tool sets on every run (:data:`OWNED_FLAGS`)."""
    return ["--training.steps", str(steps), "--job.dump_folder", dump, "--metrics.log_freq", "1"]


def child_env(side: Side) -> dict:
    """The environment of a run of ``side``: inherited, with its config as CONFIG_FILE and
    its tree first on PYTHONPATH."""
    env = dict(os.environ)
    env["CONFIG_FILE"] = side.config_file
    env.pop("CONFIG", None)  # resolved into CONFIG_FILE
    env["PYTHONPATH"] = side.root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def join_flag_values(argv: list[str]) -> list[str]:
    """``--b-flags --compile.x`` -> ``--b-flags=--compile.x`` (argparse would take the
    value for an option)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a in ("--a-flags", "--b-flags") and i + 1 < len(argv) and argv[i + 1] != "--":
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def split_flags(value: str | None, opt: str) -> list[str]:
    """``--a-flags`` / ``--b-flags`` (``opt``) as a list; CompareError if badly quoted."""
    try:
        return shlex.split(value or "")
    except ValueError as e:
        raise CompareError(f"{opt} {value!r} is not a valid shell-quoted string: {e}") from None


def side_label(side: Side) -> str:
    """``ref@sha8`` or ``working tree``, then ``+ flags`` when the side has flags."""
    base = f"{side.ref}@{side.commit[:8]}" if side.ref else "working tree"
    return base + (" + " + shlex.join(side.flags) if side.flags else "")


def resolve_sides(args: argparse.Namespace, extra: list[str], tmpdir_holder: list) -> dict:
    """Resolve both sides (refs, worktrees, configs, labels) from the CLI arguments.

    ``args`` needs ``a``, ``b``, ``a_flags``, ``b_flags``, ``a_label``, ``b_label``,
    ``repo``, ``allow_dirty`` and ``config_file``; ``extra`` are the arguments after
    ``--``. The temporary folder and worktrees created are recorded in
    ``tmpdir_holder`` for :func:`remove_worktrees`. Returns ``{"repo", "head",
    "config", "config_source", "sides": {"A": Side, "B": Side}}``. Raises CompareError.
    """
    repo = os.path.abspath(args.repo) if args.repo else default_repo()
    if not os.path.isdir(repo):
        raise CompareError(f"--repo {repo} is not a folder.")
    check_owned_flags(extra, "the arguments after --")
    sides = {}
    for name, ref, flags, label in (("A", args.a, args.a_flags, args.a_label),
                                    ("B", args.b, args.b_flags, args.b_label)):
        fl = split_flags(flags, f"--{name.lower()}-flags")
        check_owned_flags(fl, f"--{name.lower()}-flags")
        sides[name] = Side(name=name, ref=ref, flags=fl)

    # 1. refs (cheap, git only) and the dirty-tree rule.
    r = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD", check=False)
    head = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None
    dirty = dirty_paths(repo) if head else []
    refs = [s for s in sides.values() if s.ref is not None]
    if refs:
        for s in refs:
            s.commit = resolve_ref(repo, s.ref)
        at_head = [s for s in refs if s.commit == head]
        if at_head and dirty and not args.allow_dirty:
            names = ", ".join(f"--{s.name.lower()} {s.ref}" for s in at_head)
            shown = ", ".join(dirty[:5]) + (f", ... ({len(dirty)} paths)" if len(dirty) > 5 else "")
            raise CompareError(
                f"{names} {'are' if len(at_head) > 1 else 'is'} HEAD ({head[:8]}), but the working tree has uncommitted changes "
                f"({shown}); the ref side would run the committed HEAD without them. "
                f"Commit or stash, or use flags-only sides (leave out --a/--b for the side that "
                f"should run the working tree), or pass --allow-dirty to run the committed HEAD anyway."
            )
    for s in sides.values():
        if s.ref is None:
            s.root, s.commit, s.dirty = repo, head, dirty[:50]
            if not os.path.isfile(os.path.join(repo, "run_train.sh")):
                raise CompareError(f"{repo} has no run_train.sh; pass --repo with the graph_trainer tree.")
    # 2. worktrees (one per distinct commit).
    if refs:
        tmp = tempfile.mkdtemp(prefix="graph_trainer_compare_")
        tmpdir_holder.append(tmp)
        by_commit: dict[str, str] = {}
        for s in refs:
            if s.commit not in by_commit:
                path = os.path.join(tmp, f"{s.name}_{s.commit[:8]}")
                r = _git(repo, "worktree", "add", "--detach", path, s.commit, check=False)
                if r.returncode != 0:
                    raise CompareError(f"git worktree add for {s.ref} failed: {r.stderr.strip()}")
                tmpdir_holder.append(("worktree", repo, path))
                by_commit[s.commit] = path
            s.root, s.worktree = by_commit[s.commit], True
            if not os.path.isfile(os.path.join(s.root, "run_train.sh")):
                raise CompareError(f"ref {s.ref} ({s.commit[:8]}) has no run_train.sh; it predates the trainer.")
    # 3. config and labels.
    config, config_src = resolve_config(args.config_file, os.environ)
    for s in sides.values():
        config_for_side(config, s)
        s.label = side_label(s)
    if args.a_label:
        sides["A"].label = args.a_label
    if args.b_label:
        sides["B"].label = args.b_label
    return {"repo": repo, "head": head, "config": config, "config_source": config_src, "sides": sides}


def validate_sides(sides: dict, extra: list[str], steps: int, dump: str) -> None:
    """The trainer's config check for both sides (in parallel). Raises CompareError."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as ex:
        seen = {}
        for s in sides.values():
            key = (s.root, s.config_file, tuple(s.flags))
            if key not in seen:
                seen[key] = ex.submit(validate_flags, s, extra, steps, dump)
            jobs[s.name] = seen[key]
        errors = {n: f.result() for n, f in jobs.items()}
    bad = [n for n in ("A", "B") if errors[n]]
    if bad:
        msgs = []
        for n in bad:
            s = sides[n]
            msgs.append(
                f"side {n} ({s.label}): run_train.sh would reject its flags "
                f"[{shlex.join(s.flags + extra)}]:\n{errors[n]}"
            )
        raise CompareError("\n\n".join(msgs))


def remove_worktrees(holder: list) -> None:
    """Remove the temporary worktrees (and their folder); prune git's worktree list."""
    repos = set()
    for item in reversed(holder):
        if isinstance(item, tuple) and item[0] == "worktree":
            _, repo, path = item
            _git(repo, "worktree", "remove", "--force", path, check=False)
            repos.add(repo)
        elif isinstance(item, str):
            shutil.rmtree(item, ignore_errors=True)
    for repo in repos:
        _git(repo, "worktree", "prune", check=False)
    holder.clear()


def add_side_arguments(p: argparse.ArgumentParser) -> None:
    """The options every two-sided tool takes (compare_mfu, loss_compare, numerics_diff):
    ``--a/--b`` (git refs), ``--a-flags/--b-flags``, ``--a-label/--b-label``,
    ``--config-file``, ``--repo``, ``--allow-dirty``, ``--run-timeout``, ``-v``."""
    p.add_argument("--a", metavar="REF", help="git ref of side A (run from a temporary worktree)")
    p.add_argument("--b", metavar="REF", help="git ref of side B")
    p.add_argument("--a-flags", default=None, metavar="FLAGS",
                   help='extra run_train.sh flags of side A, one shell-quoted string ("" for none)')
    p.add_argument("--b-flags", default=None, metavar="FLAGS", help="extra run_train.sh flags of side B")
    p.add_argument("--a-label", help="name of side A (default: ref@sha / working tree + flags)")
    p.add_argument("--b-label", help="name of side B")
    p.add_argument("--config-file", help="TOML config (default: $CONFIG_FILE, $CONFIG, train_configs/debug_model.toml)")
    p.add_argument("--repo", help="git repository / tree to compare (default: the one holding this tool)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="allow a ref side that is HEAD while the working tree has uncommitted changes "
                   "(runs the committed HEAD, not your changes)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S",
                   help="kill a run after S seconds and record it as failed")
    p.add_argument("-v", "--verbose", action="store_true", help="stream every run's full output")


def parse_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """Parse a two-sided tool's command line (``sys.argv[1:]`` when ``argv`` is None): the
    options before ``--`` with ``parser``, and the ``run_train.sh`` arguments after it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    return parser.parse_args(join_flag_values(argv)), extra


def run_cli(body) -> int:
    """Run ``body(holder) -> exit code`` with this tool's error handling: a CompareError
    prints one paragraph and gives 2, Ctrl-C gives 130; the temporary worktrees that
    ``body`` records in ``holder`` are removed in every case."""
    holder: list = []
    try:
        return body(holder)
    except CompareError as e:
        print(f"\nerror: {e}\n", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        remove_worktrees(holder)


