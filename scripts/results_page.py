#!/usr/bin/env python3
"""Regenerate the results page docs/perf.md from the JSON records under docs/results/.

Every device call leaves one record, ``docs/results/<YYYY-MM-DD>_<slug>.json`` (``"kind": "bench"``:
a table of variants; ``"kind": "tier"``: a table of test claims). The page is the prose template
``docs/results/template.md`` with its one ``{{records}}`` line replaced by one section per
group. A bench group is a (workload, device): its latest record (by date, UTC ``time`` where
recorded, then file name); older
records stay in docs/results/ and are only counted. A tier group is a model: each claim's latest
result over the group's records on any device (tier calls often run a subset, ``TIER_K``), with the
call and, when they differ, the device it came from. Tier groups come first, then bench groups by
workload and device. A bench group whose latest record lists, in ``superseded_by``, the later records
that measured its variants again is only named. A record whose ``git_tree`` (the tree that ran) is a
commit's is shown with that commit (``git log``). Stdlib and git only; the output holds no timestamp,
so regenerating is idempotent.

    python3 scripts/results_page.py                   # write docs/perf.md
    python3 scripts/results_page.py --check           # exit 1 if docs/perf.md is stale, write nothing
    python3 scripts/results_page.py --results /tmp/results --out /tmp/perf.md

Exit status: 0 written / up to date; 1 ``--check`` found the page stale; 2 a bad template or
record, or a page over 250 lines (MAX_PAGE_LINES; one-line message, no traceback).
Paths given relative are relative to the repository root (the parent of scripts/).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = "docs/results"
DEFAULT_OUT = "docs/perf.md"
TEMPLATE_NAME = "template.md"
PLACEHOLDER = "{{records}}"
MAX_TEMPLATE_LINES = 60
MAX_PAGE_LINES = 250
SCHEMA = 1
MISSING = "–"
FAILED = "failed"

#: Fields every record needs, and those of each kind.
COMMON_FIELDS = ("schema", "kind", "workload", "title", "date", "device", "torch", "git_sha", "command")
KIND_FIELDS = {"bench": ("variants",), "tier": ("claims",)}
VARIANT_FIELDS = ("name", "tps")
CLAIM_FIELDS = ("claim", "what", "result")
DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
BENCH_HEADER = ("variant", "tps/GPU median (min–max)", "vs first", "verdict", "MFU", "peak GiB",
                "predicted GiB", "compile s", "to step 2 s (first / later)")
BENCH_ALIGN = ("---", "---:", "---:", "---", "---:", "---:", "---:", "---:", "---:")


class PageError(Exception):
    """A refusal: its message is printed as one line and the script exits 2."""


# --------------------------------------------------------------------------- paths


def resolve(path: str | Path) -> Path:
    """``path`` made absolute: relative paths are taken from the repository root."""
    path = Path(path)
    return path if path.is_absolute() else REPO / path


def shown(path: Path) -> str:
    """``path`` as messages and the page name it: relative to the repository root when inside it."""
    try:
        return path.resolve().relative_to(REPO).as_posix()
    except ValueError:
        return path.as_posix()


# --------------------------------------------------------------------------- loading


def load_template(results: Path) -> str:
    """The text of ``results/template.md``, refused unless it has at most :data:`MAX_TEMPLATE_LINES`
    lines and exactly one line reading :data:`PLACEHOLDER`."""
    path = results / TEMPLATE_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PageError(f"{shown(path)}: cannot read the template ({type(e).__name__}: {e})") from None
    lines = text.splitlines()
    if len(lines) > MAX_TEMPLATE_LINES:
        raise PageError(f"{shown(path)}: template has {len(lines)} lines, at most {MAX_TEMPLATE_LINES} allowed")
    count = sum(line.strip() == PLACEHOLDER for line in lines)
    if count != 1:
        raise PageError(f"{shown(path)}: template needs exactly one line '{PLACEHOLDER}', found {count}")
    return text


def record_files(results: Path) -> list[Path]:
    """The ``*.json`` files directly under ``results``, sorted by name."""
    if not results.is_dir():
        raise PageError(f"{shown(results)}: no such results directory")
    return sorted(p for p in results.glob("*.json") if p.is_file())


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; anything else is refused naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PageError(f"{shown(path)}: not valid JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PageError(f"{shown(path)}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise PageError(f"{shown(path)}: a record must be a JSON object, not {type(data).__name__}")
    return data


def require(path: Path, obj: dict, fields: tuple[str, ...], where: str = "") -> None:
    """Refuse ``obj`` (found at ``where`` in ``path``) if one of ``fields`` is absent or null."""
    for field in fields:
        if obj.get(field) is None:
            raise PageError(f"{shown(path)}: missing required field '{where}{field}'")


def require_list(path: Path, record: dict, field: str, fields: tuple[str, ...]) -> None:
    """Refuse ``record[field]`` unless it is a non-empty list of objects each with ``fields``."""
    items = record[field]
    if not isinstance(items, list) or not items:
        raise PageError(f"{shown(path)}: field '{field}' must be a non-empty list")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise PageError(f"{shown(path)}: field '{field}[{i}]' must be an object")
        require(path, item, fields, f"{field}[{i}].")


def validate(path: Path, record: dict) -> dict:
    """``record`` after checking its schema, kind, date and required fields (naming file and field)."""
    require(path, record, COMMON_FIELDS)
    if record["schema"] != SCHEMA:
        raise PageError(f"{shown(path)}: field 'schema' is {record['schema']!r}, this script reads {SCHEMA}")
    if record["kind"] not in KIND_FIELDS:
        raise PageError(f"{shown(path)}: field 'kind' is {record['kind']!r}, expected one of {sorted(KIND_FIELDS)}")
    for field in ("workload", "title", "date", "device", "torch", "git_sha", "command"):
        if not isinstance(record[field], str):
            raise PageError(f"{shown(path)}: field '{field}' must be a string")
    if not DATE_RE.fullmatch(record["date"]):
        raise PageError(f"{shown(path)}: field 'date' is {record['date']!r}, expected YYYY-MM-DD")
    require(path, record, KIND_FIELDS[record["kind"]])
    if record["kind"] == "bench":
        require_list(path, record, "variants", VARIANT_FIELDS)
    else:
        require_list(path, record, "claims", CLAIM_FIELDS)
    return record


def load_records(results: Path) -> list[tuple[Path, dict]]:
    """Every record under ``results`` as ``(file, record)``, validated, in file-name order, each named by the commit
    that ran (:func:`committed_as`)."""
    return [(path, committed_as(validate(path, read_json(path)))) for path in record_files(results)]


@functools.lru_cache(maxsize=None)
def commits_by_tree(repo: Path) -> dict[str, str]:
    """Tree id -> the oldest commit of ``repo``'s history (``git log HEAD``) with that tree; empty without git."""
    r = subprocess.run(["git", "-C", str(repo), "log", "--reverse", "--format=%T %H", "HEAD"], capture_output=True,
                       text=True)
    out: dict[str, str] = {}
    for tree, sha in (line.split() for line in (r.stdout.splitlines() if r.returncode == 0 else [])):
        out.setdefault(tree, sha)
    return out


def committed_as(record: dict) -> dict:
    """A ``git_dirty`` record with the commit whose tree is its ``git_tree`` (the working tree that ran, as ``git add
    -A`` would commit it; scripts/bench.py and the tier record it) as ``git_sha``, clean: a call runs on a copy whose
    git HEAD can be older than the tree. Unchanged when clean or when no commit has that tree."""
    sha = commits_by_tree(REPO).get(record.get("git_tree") or "") if record.get("git_dirty") else None
    return {**record, "git_sha": sha, "git_dirty": False} if sha else record


# --------------------------------------------------------------------------- grouping


def group_key(record: dict) -> tuple[str, str, str]:
    """The group a record belongs to: ``(kind, workload, device)``; a tier record's is
    ``(kind, model (else its workload), "")``: a numerics claim's latest result counts on any device."""
    if record["kind"] == "tier":
        return record["kind"], record.get("model") or record["workload"], ""
    return record["kind"], record["workload"], record["device"]


def merge_tier(members: list[dict]) -> dict:
    """One tier record of a group's ``members`` (oldest first): the latest's fields, each claim's
    latest result with its call's ``git_sha`` (``call``, plus the device when the calls ran on several),
    every contributing call's command and note. A claim ``NOT RUN`` in a later call keeps its earlier result."""
    latest: dict[str, tuple[int, dict]] = {}  # claim -> (index of its record in members, the claim)
    for i, record in enumerate(members):
        for c in record["claims"]:
            if c["result"] != "NOT RUN" or c["claim"] not in latest:
                latest[c["claim"]] = (i, {**c, "call": record["git_sha"][:8], "device": record["device"]})
    used = [members[i] for i in sorted({i for i, _ in latest.values()})]
    if len(used) == 1:
        return used[0]
    model, devices = members[-1].get("model"), {r["device"] for r in used}
    return {**members[-1], "title": f"GPU tier, {model}" if model else members[-1]["title"],
            "device": " / ".join(sorted(devices)),
            "devices": len(devices),
            "claims": [latest[k][1] for k in sorted(latest)], "calls": len(used),
            "command": "\n".join(dict.fromkeys(r["command"] for r in used)),
            "note": " ".join(dict.fromkeys(f"`{r['git_sha'][:8]}`: {r['note']}" for r in used if r.get("note")))
            or None}


def latest_per_group(records: list[tuple[Path, dict]]) -> tuple[list[tuple[dict, int]], list[str]]:
    """``(record, number of records not shown)`` per group, in page order: tier groups first, then
    bench groups, each by workload then device. Bench: the latest, greatest (date, time, file name);
    tier: :func:`merge_tier` of the group (records none of whose claims is shown are counted). A bench
    group whose latest record names, in ``superseded_by``, the later records that measured its variants
    again is left out; the second list names each such record and its successors (markdown)."""
    names = {path.name for path, _ in records}
    for path, record in records:
        later = record.get("superseded_by")
        if later is not None and not (isinstance(later, list) and later and all(n in names for n in later)):
            raise PageError(f"{shown(path)}: field 'superseded_by' must list record files in {shown(path.parent)}/")
    groups: dict[tuple[str, str, str], list[tuple[Path, dict]]] = {}
    for path, record in records:
        groups.setdefault(group_key(record), []).append((path, record))
    out, superseded = [], []
    for key in sorted(groups, key=lambda k: (k[0] != "tier", k[1], k[2])):
        members = sorted(groups[key], key=lambda pr: (pr[1]["date"], str(pr[1].get("time", "")), pr[0].name))
        path, latest = members[-1]
        if key[0] == "bench" and latest.get("superseded_by"):
            superseded.append(f"`{path.name}` (by {', '.join(f'`{n}`' for n in latest['superseded_by'])})")
            continue
        shown_record = merge_tier([r for _, r in members]) if key[0] == "tier" else latest
        out.append((shown_record, len(members) - shown_record.get("calls", 1)))
    return out, superseded


# --------------------------------------------------------------------------- formatting


def median(stat) -> float | None:
    """The median of a statistics object ``{"median": …}`` (a bare number is its own median)."""
    if isinstance(stat, dict):
        stat = stat.get("median")
    return float(stat) if isinstance(stat, (int, float)) and not isinstance(stat, bool) else None


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` plus ``suffix``, or :data:`MISSING` when absent."""
    return MISSING if value is None else f"{value:{spec}}{suffix}"


def cell(text) -> str:
    """``text`` as one table cell: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def row(cells) -> str:
    """One markdown table row."""
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def failed(variant: dict) -> bool:
    """Whether a variant had no successful run (``tps.n == 0`` or no tps median)."""
    tps = variant["tps"]
    return (isinstance(tps, dict) and tps.get("n") == 0) or median(tps) is None


def tps_cell(tps) -> str:
    """``41,847 (41,000–42,500)``: median with the range of the repeats when known."""
    text = fmt(median(tps), ",.0f")
    if isinstance(tps, dict):
        low, high = median(tps.get("min")), median(tps.get("max"))
        if low is not None and high is not None:
            text += f" ({low:,.0f}–{high:,.0f})"
    return text


def ratio_cell(variant: dict, index: int, first: dict) -> str:
    """The variant's ``ratio`` (else its median over the first variant's) as ``1.130×``; the first is 1.000×."""
    ratio = median(variant.get("ratio"))
    if ratio is None and index == 0:
        ratio = 1.0
    if ratio is None and not failed(first) and median(first["tps"]) > 0:
        ratio = median(variant["tps"]) / median(first["tps"])
    return fmt(ratio, ".3f", "×")


def variant_row(variant: dict, index: int, first: dict, repeats: int | None = None) -> str:
    """The bench table row of one variant; measured cells read "failed" when no run succeeded; the name says
    ``(2 of 3 runs)`` when fewer runs succeeded than the record's ``repeats`` (a deadline, a failed run)."""
    predicted = fmt(median(variant.get("predicted_peak_gib")), ".2f")
    if failed(variant):
        verdict = variant.get("verdict") or FAILED
        return row([variant["name"], FAILED, FAILED, verdict, FAILED, FAILED, predicted, FAILED, FAILED])
    n = variant["tps"].get("n") if isinstance(variant["tps"], dict) else None
    cut = isinstance(n, int) and isinstance(repeats, int) and n < repeats
    return row([
        variant["name"] + (f" ({n} of {repeats} runs)" if cut else ""),
        tps_cell(variant["tps"]),
        ratio_cell(variant, index, first),
        variant.get("verdict") or MISSING,
        fmt(median(variant.get("mfu")), ".1f", "%"),
        fmt(median(variant.get("memory_gib")), ".2f"),
        predicted,
        fmt(median(variant.get("compile_time_s")), ".0f"),
        f'{fmt(variant.get("step2_first_s"), ".0f")} / {fmt(variant.get("step2_later_s"), ".0f")}',
    ])


def bench_table(record: dict) -> list[str]:
    """The variants table of a bench record."""
    variants, repeats = record["variants"], (record.get("settings") or {}).get("repeats")
    lines = [row(BENCH_HEADER), "|" + "|".join(BENCH_ALIGN) + "|"]
    return lines + [variant_row(v, i, variants[0], repeats) for i, v in enumerate(variants)]


def profile_table(record: dict) -> list[str]:
    """Where a bench record's profiled step went per variant and rank (``profile``, written by
    ``graph_trainer.tools.bench.profile_summary``): wall = compute + exposed communication + idle (of it,
    when recorded, the part that waited for the host's launch), ms, beside the wall the profiled run's median step
    (``runs``' ``step_time_s``, when recorded: a wall above it is the profiler's cost) and (when recorded) the most
    exposed collectives; nothing when the record has none. One line instead of the table when each variant has one
    rank and none communicated (one GPU)."""
    prof = record.get("profile")
    if not isinstance(prof, dict) or not prof.get("variants"):
        return []
    first = {}  # each variant's median step (ms) in its first run that has one: the run bench profiled
    for run in record.get("runs") or []:
        if run.get("step_time_s"):
            first.setdefault(run["variant"], run["step_time_s"] * 1e3)
    ranks = [(name, {"step_ms": first.get(name), **r}) for name, rs in prof["variants"].items() for r in rs]
    colls = any(r.get("collectives") for _, r in ranks)

    def times(r: dict, *keys: str) -> list[str]:  # ms: the wall with the median step, the idle with the host's part
        cells = [fmt(r.get(k), ".1f") for k in (*keys, "idle_ms")]
        cells[0] += f" (median step {r['step_ms']:.1f})" if r.get("step_ms") else ""
        return cells[:-1] + [cells[-1] + (f" (host {r['idle_host_ms']:.1f})" if r.get("idle_host_ms") is not None
                                          else "")]

    if len(ranks) == len(prof["variants"]) and not colls and not any(r.get("exposed_comm_ms") for _, r in ranks):
        return [f"Step {prof.get('step', MISSING)} profiled (one rank, no communication), ms wall / compute / idle: "
                + ", ".join(f"{name} {' / '.join(times(r, 'wall_ms', 'compute_ms'))}" for name, r in ranks) + ".", ""]
    header = [f"step {prof.get('step', MISSING)} profiled, ms", "rank", "wall", "compute", "exposed comm", "idle"] \
        + ["most exposed collectives (ms)"] * colls
    lines = [row(header), "|---|---:|---:|---:|---:|---:|" + "---|" * colls]
    for name, r in ranks:
        cells = [name, r["rank"], *times(r, "wall_ms", "compute_ms", "exposed_comm_ms")]
        if colls:
            worst = (r.get("collectives") or {}).items()
            cells.append(", ".join(f"{label} {c['exposed_ms']:.1f}" for label, c in worst) or MISSING)
        lines.append(row(cells))
    return lines + [""]


def tier_table(record: dict) -> list[str]:
    """The claims table of a tier record; the detail column only when some claim has one. Claims of one test that
    differ only in its parameters (same what, result, call and detail) share the first one's row: ``test[a, b]``."""
    claims = record["claims"]
    detail, calls = any(c.get("detail") for c in claims), record.get("calls", 1) > 1
    header = ["claim", "what", "result"] + (["call"] if calls else []) + (["detail"] if detail else [])
    groups: dict[tuple, tuple[list[str], dict]] = {}  # what a row shows but the parameters: (parameters, a claim)
    for c in claims:
        test, bracket, param = c["claim"].partition("[")
        key = (test, c["what"], c["result"], c.get("call"), c.get("device"), c.get("detail"), bool(bracket))
        groups.setdefault(key if bracket else (c["claim"],), ([], c))[0].extend([param[:-1]] if bracket else [])
    lines = [row(header), "|" + "|".join("---" for _ in header) + "|"]
    for (test, *_), (params, c) in groups.items():
        call = [f"`{c['call']}`" + (f", {c['device']}" if record.get("devices", 1) > 1 else "")] if calls else []
        name = f"{test}[{', '.join(params)}]" if params else test
        cells = [f"`{name}`", c["what"], c["result"], *call] + ([c.get("detail") or MISSING] if detail else [])
        lines.append(row(cells))
    return lines


def meta_line(record: dict) -> str:
    """``<date>, torch <version>, git <sha, 8 characters>`` plus the settings when recorded."""
    sha = record["git_sha"][:8] or MISSING
    line = f"{record['date']}, torch {record['torch']}, git `{sha}`"
    line += " + uncommitted changes" if record.get("git_dirty") else ""
    if record.get("calls", 1) > 1:
        line += f" (the latest of {record['calls']} calls; each claim's call in its row)"
    settings = record.get("settings")
    if isinstance(settings, dict) and settings:  # the layout flags are in the command below
        line += " (" + ", ".join(f"{k} {v}" for k, v in settings.items() if k != "extra_args") + ")"
    return line


def code_block(command: str) -> list[str]:
    """``command`` in a ```bash fence longer than any backtick run inside it."""
    fence = "`" * max(3, _longest_backticks(command) + 1)
    return [f"{fence}bash", *command.splitlines(), fence]


def inline_code(command: str) -> str:
    """``command`` (one line) as inline code, its delimiter longer than any backtick run inside it."""
    tick = "`" * (_longest_backticks(command) + 1)
    pad = " " if command.startswith("`") or command.endswith("`") else ""
    return f"{tick}{pad}{command}{pad}{tick}"


def _longest_backticks(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


def profile_links(record: dict, out: Path, results: Path) -> str:
    """``; profile: [jit](…), [plain](…)`` for the meta line: links to the record's profile pictures
    (``profile_png``: a path or a list; a bare file name lies beside the records in ``results``, a path with a
    folder is repo-relative), relative to the page, each named by its variant (its file name when no variant's name
    ends it); a picture that is not there is named, not linked. Empty without pictures."""
    pngs = record.get("profile_png") or []
    variants = [v.get("name", "") for v in record.get("variants", [])]
    links = []
    for png in [pngs] if isinstance(pngs, str) else pngs:
        where = results / png if Path(png).name == png else resolve(png)
        name = next((v for v in variants if v and Path(png).stem.endswith("_" + v)), Path(png).name)
        links.append(f"[{name}]({os.path.relpath(where, out.parent).replace(os.sep, '/')})" if where.is_file()
                     else f"{name} (not kept)")
    return f"; profile: {', '.join(links)}" if links else ""


def earlier_note(count: int, results: Path) -> str:
    """``; 2 earlier records in docs/results/`` for the meta line (nothing when the group has one record)."""
    if count == 0:
        return ""
    return f"; {count} earlier {'record' if count == 1 else 'records'} in {shown(results)}/"


def section(record: dict, earlier: int, results: Path, out: Path) -> list[str]:
    """The lines of one group's section, ending with a blank line."""
    bench, command = record["kind"] == "bench", record["command"].strip()
    meta = meta_line(record) + earlier_note(earlier, results) + profile_links(record, out, results)
    table, profile = (bench_table(record), profile_table(record)) if bench else (tier_table(record), [])
    lines = [f"### {cell(record['title'])} — {cell(record['device'])}"]
    if bench and "\n" not in command:  # one command: on the meta line
        lines += [f"{meta}; command: {inline_code(command)}", "", *table, "", *profile]
    else:  # a table ends where the commands' fence begins (GitHub's Markdown)
        lines += [meta, "", *table, *code_block(command), *(profile or [""])]
    if record.get("note"):
        lines += [" ".join(str(record["note"]).split()), ""]
    return lines


# --------------------------------------------------------------------------- the page


def header(results: Path) -> str:
    """The page's first line: where it comes from (no date, so regeneration is idempotent)."""
    return (f"<!-- generated by `python3 scripts/results_page.py` from {shown(results)}/ "
            f"(records + {TEMPLATE_NAME}); do not edit by hand -->")


def render(results: Path, out: Path) -> str:
    """The whole page: header line, then the template with the sections in place of its placeholder."""
    template = load_template(results)
    groups, superseded = latest_per_group(load_records(results))
    body: list[str] = []
    for record, earlier in groups:
        body += section(record, earlier, results, out)
    body += [f"_Superseded, not shown: {'; '.join(superseded)}._", ""] if superseded else []
    while body and body[-1] == "":
        body.pop()
    if not body:
        body = [f"_No records in {shown(results)}/._"]
    lines = [header(results)]
    for line in template.splitlines():
        lines += body if line.strip() == PLACEHOLDER else [line]
    page = "\n".join(lines).rstrip("\n") + "\n"
    check_length(page, out)
    return page


def check_length(page: str, out: Path) -> None:
    """Refuse a page over :data:`MAX_PAGE_LINES` lines (policy: the page shows latest results only)."""
    n = len(page.splitlines())
    if n > MAX_PAGE_LINES:
        raise PageError(f"{shown(out)} would have {n} lines, the limit is {MAX_PAGE_LINES}: shorten the "
                        f"template or notes, or merge workloads (older records are never rendered)")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its directory and ``os.replace``
    (keeping an existing page's permissions, else 0644)."""
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)  # our own temporary file only
        raise


def current(out: Path) -> str | None:
    """The text of the existing page, or None if there is none."""
    try:
        return out.read_text(encoding="utf-8")
    except (FileNotFoundError, UnicodeDecodeError):
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--results", default=DEFAULT_RESULTS,
                   help=f"directory of the JSON records and {TEMPLATE_NAME} (default: {DEFAULT_RESULTS})")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"the page to write (default: {DEFAULT_OUT})")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if the page differs from what would be generated; write nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Generate (or ``--check``) the page; returns the exit status."""
    args = parse_args(argv)
    results, out = resolve(args.results), resolve(args.out)
    try:
        page = render(results, out)
    except PageError as e:
        print(f"results_page: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if current(out) != page:
            print(f"results_page: {shown(out)} is out of date: run python3 scripts/results_page.py")
            return 1
        print(f"results_page: {shown(out)} is up to date")
        return 0
    if current(out) == page:
        print(f"results_page: {shown(out)} unchanged")
        return 0
    write_atomic(out, page)
    print(f"results_page: wrote {shown(out)} ({len(page.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
