"""The two sides of a comparison and the tools' shared CLI: a side is a git ref (run from a temporary
``git worktree``), extra ``run_train.sh`` flags, or both; with neither, the working tree of ``--repo``."""

import argparse
import contextlib
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from graph_trainer.config import CONFIG_NAMES

# Flags the tools set on every run, and what to use instead.
OWNED_FLAGS = {"--training.steps": "--steps", "--job.dump_folder": "--out", "--metrics.log_freq": "(always 1)"}


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
    env: dict = field(default_factory=dict)  # set in its runs' environment (bench's NAME=VALUE words)

    def describe(self) -> dict:
        """The side as recorded in the tools' JSON output."""
        return {"label": self.label, "ref": self.ref, "commit": self.commit, "flags": self.flags, "tree": self.root,
                "worktree": self.worktree, "config_file": self.config_file,
                **({} if self.worktree else {"uncommitted_changes": self.dirty})}


def _git(repo: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, env=env)


def git_out(repo: str, *args: str, env: dict | None = None) -> str | None:
    return (r.stdout.strip() or None) if (r := _git(repo, *args, env=env)).returncode == 0 else None


def git_state(repo: str) -> dict:
    """A record's ``git_sha`` (HEAD), ``git_dirty`` (tracked files changed) and ``git_tree``: the tree ``git add -A``
    would commit, built in a temporary index (index and files untouched; blobs written). None where git fails."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        staged = all(_git(repo, *a, env=env).returncode == 0 for a in (("read-tree", "HEAD"), ("add", "-A")))
        tree = git_out(repo, "write-tree", env=env) if staged else None
    return {"git_sha": git_out(repo, "rev-parse", "HEAD"), "git_tree": tree,
            "git_dirty": bool(git_out(repo, "status", "--porcelain", "--untracked-files=no"))}


def default_repo() -> str:
    """The tree holding this package's run_train.sh, else the git top level of the cwd."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.path.isfile(os.path.join(here, "run_train.sh")):
        return here
    return git_out(os.getcwd(), "rev-parse", "--show-toplevel") or os.getcwd()


def check_owned_flags(flags: list[str], where: str) -> None:
    """Raise CompareError if ``flags`` set one of :data:`OWNED_FLAGS` (``where`` names them)."""
    for key in (f.split("=", 1)[0] for f in flags):
        if key in OWNED_FLAGS:
            raise CompareError(
                f"{where} sets {key}, which this tool sets for every run; use {OWNED_FLAGS[key]} instead.")


def resolve_config(cli_value: str | None, env: dict) -> tuple[str, str]:
    """(config path, its source): ``--config-file``, ``CONFIG_FILE``, ``CONFIG`` (a name of
    :data:`graph_trainer.config.CONFIG_NAMES`; CompareError if unknown) or the debug model's."""
    if cli_value:
        return cli_value, "--config-file"
    if env.get("CONFIG_FILE"):
        return env["CONFIG_FILE"], "CONFIG_FILE"
    name = env.get("CONFIG")
    if not name:
        return "train_configs/debug_model.toml", "default"
    if name not in CONFIG_NAMES:
        raise CompareError(f"CONFIG={name} is not a known config name ({', '.join(sorted(CONFIG_NAMES))}); "
                           f"or set CONFIG_FILE / --config-file to a TOML file.")
    return f"train_configs/{CONFIG_NAMES[name]}", f"CONFIG={name}"


def config_for_side(config: str, side: Side) -> None:
    """A relative config is taken from the side's tree when there, else from the cwd."""
    if os.path.isfile(os.path.join(side.root, config)):  # an absolute path as it is
        side.config_file = config
        side.config_note = "absolute path" if os.path.isabs(config) else "from the side's tree"
    elif not os.path.isabs(config) and os.path.isfile(config):
        side.config_file = os.path.abspath(config)
        side.config_note = "not in the side's tree; from the current directory"
    else:
        where = "" if os.path.isabs(config) else f" in side {side.name}'s tree ({side.root}) or the current directory"
        raise CompareError(f"config file '{config}' does not exist{where}.")


def check_run_args(args: argparse.Namespace) -> None:
    """compare_mfu / bench: CompareError for a bad ``--repeats``, ``--warmup``, ``--steps`` or ``--profile-step``."""
    first = max(args.warmup, 1)
    if args.repeats < 1:
        raise CompareError(f"--repeats must be >= 1, got {args.repeats}.")
    if args.warmup < 0:
        raise CompareError(f"--warmup must be >= 0, got {args.warmup}.")
    if args.steps <= first:
        raise CompareError(f"--steps {args.steps} leaves no step to measure: steps 1..{first} are excluded "
                           f"(--warmup {args.warmup}; step 1 always). Use --steps > {first}.")
    if args.profile_step is not None and not 2 <= args.profile_step <= args.steps:
        raise CompareError(f"--profile-step must be in 2..--steps ({args.steps}), got {args.profile_step}.")


def forced_flags(steps: int, dump: str) -> list[str]:
    """The run_train.sh flags the tools set on every run (:data:`OWNED_FLAGS`)."""
    return ["--training.steps", str(steps), "--job.dump_folder", dump, "--metrics.log_freq", "1"]


def child_env(side: Side) -> dict:
    """The environment of a run of ``side``: inherited, its config as CONFIG_FILE, its tree first on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "CONFIG"}  # CONFIG is resolved into CONFIG_FILE
    path = os.pathsep.join(p for p in (side.root, env.get("PYTHONPATH")) if p)
    return {**env, **side.env, "CONFIG_FILE": side.config_file, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def resolve_sides(args: argparse.Namespace, extra: list[str], cleanup: contextlib.ExitStack) -> dict:
    """Resolve both sides (refs, worktrees, configs, labels) of the parsed CLI arguments; ``extra``: the arguments after
    ``--``; ``cleanup`` removes the worktrees. Returns ``{"repo", "head", "config", "config_source", "sides": {"A":
    Side, "B": Side}}``. Raises CompareError."""
    repo = os.path.abspath(args.repo) if args.repo else default_repo()
    if not os.path.isdir(repo):
        raise CompareError(f"--repo {repo} is not a folder.")
    check_owned_flags(extra, "the arguments after --")
    sides = {}
    for name, ref, flags in (("A", args.a, args.a_flags), ("B", args.b, args.b_flags)):
        opt = f"--{name.lower()}-flags"
        try:
            fl = shlex.split(flags or "")
        except ValueError as e:
            raise CompareError(f"{opt} {flags!r} is not a valid shell-quoted string: {e}") from None
        check_owned_flags(fl, opt)
        sides[name] = Side(name=name, ref=ref, flags=fl)

    head = git_out(repo, "rev-parse", "--verify", "--quiet", "HEAD")
    dirty = []
    if head and (r := _git(repo, "status", "--porcelain", "--untracked-files=normal")).returncode == 0:
        dirty = [line[3:] for line in r.stdout.splitlines() if line.strip()]
    refs = [s for s in sides.values() if s.ref is not None]
    for s in refs:
        s.commit = git_out(repo, "rev-parse", "--verify", "--quiet", f"{s.ref}^{{commit}}")
        if s.commit is None:
            if _git(repo, "rev-parse", "--git-dir").returncode != 0:
                raise CompareError(f"--repo {repo} is not a git repository, so ref '{s.ref}' cannot be checked out.")
            raise CompareError(f"unknown git ref '{s.ref}' in {repo} (git rev-parse --verify '{s.ref}^{{commit}}' "
                               "failed). Check the branch/tag/sha; `git fetch` if it is a remote branch.")
    if (at_head := [s for s in refs if s.commit == head]) and dirty and not args.allow_dirty:
        names = ", ".join(f"--{s.name.lower()} {s.ref}" for s in at_head)
        shown = ", ".join(dirty[:5]) + (f", ... ({len(dirty)} paths)" if len(dirty) > 5 else "")
        raise CompareError(
            f"{names} {'are' if len(at_head) > 1 else 'is'} HEAD ({head[:8]}), but the working tree has uncommitted "
            f"changes ({shown}); the ref side would run the committed HEAD without them. Commit or stash, or use "
            "flags-only sides (leave out --a/--b for the side that should run the working tree), or pass "
            "--allow-dirty to run the committed HEAD anyway.")
    for s in sides.values():
        if s.ref is None:
            s.root, s.commit, s.dirty = repo, head, dirty[:50]
    if refs:  # one worktree per distinct commit
        cleanup.callback(_git, repo, "worktree", "prune")  # last
        tmp = tempfile.mkdtemp(prefix="graph_trainer_compare_")
        cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        trees: dict[str, str] = {}
        for s in refs:
            if s.commit not in trees:
                path = os.path.join(tmp, f"{s.name}_{s.commit[:8]}")
                if (r := _git(repo, "worktree", "add", "--detach", path, s.commit)).returncode:
                    raise CompareError(f"git worktree add for {s.ref} failed: {r.stderr.strip()}")
                cleanup.callback(_git, repo, "worktree", "remove", "--force", path)
                trees[s.commit] = path
            s.root, s.worktree = trees[s.commit], True
    config, source = resolve_config(args.config_file, os.environ)
    for s in sides.values():
        if not os.path.isfile(os.path.join(s.root, "run_train.sh")):
            raise CompareError(f"ref {s.ref} ({s.commit[:8]}) has no run_train.sh; it predates the trainer." if s.ref
                               else f"{repo} has no run_train.sh; pass --repo with the graph_trainer tree.")
        config_for_side(config, s)
        base = f"{s.ref}@{s.commit[:8]}" if s.ref else "working tree"
        s.label = getattr(args, f"{s.name.lower()}_label") or base + (" + " + shlex.join(s.flags) if s.flags else "")
    return {"repo": repo, "head": head, "config": config, "config_source": source, "sides": sides}


def _check_flags(side: Side, extra: list[str], steps: int, dump: str) -> str | None:
    cmd = ["python3", "-m", "graph_trainer.config", "--job.config_file", side.config_file,
           *side.flags, *extra, *forced_flags(steps, dump)]
    r = subprocess.run(cmd, cwd=side.root, env=child_env(side), capture_output=True, text=True)
    if r.returncode == 0:
        return None
    text = "\n".join(l for l in (r.stderr + r.stdout).splitlines() if "HF assets path" not in l)
    return text.strip() or f"exit code {r.returncode}"


def validate_sides(sides: dict, extra: list[str], steps: int, dump: str) -> None:
    """Check every side's flags with the trainer's config parser (in parallel). Raises CompareError."""
    keys = {n: (s.root, s.config_file, tuple(s.flags)) for n, s in sides.items()}
    unique = {key: n for n, key in keys.items()}  # two identical sides are checked once
    with ThreadPoolExecutor(max_workers=2) as ex:
        jobs = {key: ex.submit(_check_flags, sides[n], extra, steps, dump) for key, n in unique.items()}
        errors = {n: jobs[key].result() for n, key in keys.items()}
    msgs = [f"side {n} ({sides[n].label}): run_train.sh would reject its flags "
            f"[{shlex.join(sides[n].flags + extra)}]:\n{errors[n]}" for n in sides if errors[n]]
    if msgs:
        raise CompareError("\n\n".join(msgs))


def tool_parser(prog: str, description: str, doc: str, tool: str, two_sided: bool = True) -> argparse.ArgumentParser:
    """A tool's parser: ``description``, the ``Examples::`` of ``doc`` as epilog, the side options
    (``two_sided``), ``--run-timeout``, ``-v`` and ``--out``."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog="examples:" + doc.split("Examples::")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if two_sided:
        p.add_argument("--a", metavar="REF", help="git ref of side A (run from a temporary worktree)")
        p.add_argument("--b", metavar="REF", help="git ref of side B")
        p.add_argument("--a-flags", default=None, metavar="FLAGS",
                       help='extra run_train.sh flags of side A, one shell-quoted string ("" for none)')
        p.add_argument("--b-flags", default=None, metavar="FLAGS", help="extra run_train.sh flags of side B")
        p.add_argument("--a-label", help="name of side A (default: ref@sha / working tree + flags)")
        p.add_argument("--b-label", help="name of side B")
        p.add_argument("--config-file",
                       help="TOML config (default: $CONFIG_FILE, $CONFIG, train_configs/debug_model.toml)")
        p.add_argument("--repo", help="git repository / tree to compare (default: the one holding this tool)")
        p.add_argument("--allow-dirty", action="store_true",
                       help="allow a ref side that is HEAD while the working tree has uncommitted changes "
                       "(runs the committed HEAD, not your changes)")
    p.add_argument("--run-timeout", type=float, default=None, metavar="S",
                   help="kill a run after S seconds and record it as failed")
    p.add_argument("-v", "--verbose", action="store_true", help="stream every run's full output")
    p.add_argument("--out", help=f"output folder of the runs (default ./outputs/{tool}_<timestamp>)")
    return p


def parse_cli(parser: argparse.ArgumentParser, argv: list[str] | None,
              joined: tuple[str, ...] = ("--a-flags", "--b-flags")) -> tuple[argparse.Namespace, list[str]]:
    """(the options before ``--``, parsed; the run_train.sh arguments after it). The options in
    ``joined`` take their value even when it starts with ``--``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    i = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:i], argv[i + 1:]
    own: list[str] = []
    for a in argv:
        if own and own[-1] in joined:
            own[-1] += "=" + a
        else:
            own.append(a)
    return parser.parse_args(own), extra


def out_folder(out: str | None, tool: str) -> str:
    """``--out`` as an absolute path; default ``./outputs/<tool>_<timestamp>``."""
    return os.path.abspath(out or os.path.join("outputs", f"{tool}_{datetime.datetime.now():%Y%m%d_%H%M%S}"))


def pair_sides(args: argparse.Namespace, extra: list[str], cleanup: contextlib.ExitStack, tool: str, steps: int,
               check_flags: list[str]) -> tuple[dict, str]:
    """loss_compare / numerics_diff: resolve the sides (the working tree twice when none is given),
    create the output folder, check the flags. Returns ``(sides, out)``; raises CompareError."""
    ns = argparse.Namespace(**vars(args))
    if all(x is None for x in (args.a, args.b, args.a_flags, args.b_flags)):
        ns.a_flags = ns.b_flags = ""  # run-to-run
    sides = resolve_sides(ns, extra, cleanup)["sides"]
    out = out_folder(args.out, tool)
    os.makedirs(out, exist_ok=True)
    validate_sides(sides, extra + check_flags, steps, os.path.join(out, "check"))
    return sides, out


def write_json(path: str, payload: dict) -> None:
    """Write ``payload`` to ``path`` atomically (a temporary file, then a rename)."""
    with open(path + ".tmp", "w") as f:
        json.dump(payload, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def run_cli(body) -> int:
    """``body(cleanup) -> exit code``: CompareError prints one paragraph and gives 2, Ctrl-C 130;
    ``cleanup`` (an ExitStack) is always closed."""
    try:
        with contextlib.ExitStack() as cleanup:
            return body(cleanup)
    except CompareError as e:
        print(f"\nerror: {e}\n", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
