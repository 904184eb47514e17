#!/usr/bin/env python3
"""Scale projection: dry runs of Llama3 8B and 70B at 8, 64 and 512 ranks, one table per model.

Every grid point is a ``COMM_MODE=fake_backend`` dry run (:mod:`graph_trainer.projection.dry_run`: the
model on the meta device, one step traced on a fake process group of that many ranks, the
graph passes of the memory policy's plan for the device) in a process of its own, with the
projection of :mod:`graph_trainer.projection.cost_model`. Layouts, per model (``--layouts``):

* ``fsdp``: FSDP over every rank;
* ``hsdp``: HSDP, FSDP inside a group of :data:`HSDP_SHARD` ranks (8B: one node; 70B: 8 nodes,
  where its fp32 state fits) replicated over the rest; skipped where that is one replica
  (the FSDP row) and, with a note, where this tree does not trace HSDP yet;
* ``fsdp_tp``: TP inside a node (:data:`TP_DEGREE`: 8B 2 as the seed layout, 70B 8 as
  torchtitan's llama3_70b.toml) x FSDP over the rest.

Prints one markdown table per model: memory per rank, the memory policy's predicted peak,
collective bytes per step by kind and mesh dimension, and the projected step. ``--validate``
instead projects the layouts docs/perf_archive.md has measured (no measured figure is kept here).
``--device``, ``--gpus-per-node``, ``--cost-constants`` and ``--async-tp`` are passed to every
dry run as the ``[projection]`` flags ``--projection.device`` (default h100; ``--validate``: each
layout's own GPU), ``--projection.gpus_per_node``, ``--projection.cost_constants`` and
``--projection.async_tp``.

    scripts/project_scale.py                          # the 8B and 70B grid on H100 nodes of 8
    scripts/project_scale.py --models 8B --worlds 8,64 --layouts fsdp --device h200
    scripts/project_scale.py --validate
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "train_configs", "llama3_8b.toml")
#: FSDP group size of the HSDP layout, per model.
HSDP_SHARD = {"8B": 8, "70B": 64}
#: TP degree of the FSDP x TP layout, per model.
TP_DEGREE = {"8B": 2, "70B": 8}
LAYOUTS = ("fsdp", "hsdp", "fsdp_tp")
#: ``(label, train_configs file, NGPU, device, flags, docs/perf_archive.md section)`` of the layouts
#: measured on GPUs; their measured tps live in docs/perf_archive.md ("Scale projection") only.
VALIDATION = (
    ("1B, 1 GPU, plain command", "llama3_1b.toml", 1, "h100", [],
     "fifth session, Call 3"),
    ("8B FSDP2, op SAC recompute", "llama3_8b.toml", 2, "h200", ["--compile.sac.save", "recompute"],
     "8B FSDP2 with SAC in effect"),
    ("8B FSDP2, SAC keeps matmuls", "llama3_8b.toml", 2, "h200", ["--compile.sac.save", "matmuls"],
     "8B FSDP2 with SAC in effect"),
    ("8B FSDP2, fastest (full Inductor, buckets of 2, 12 kept)", "llama3_8b.toml", 2, "h200",
     ["--compile.sac.save", "matmuls", "--compile.fsdp.bucket_blocks", "2", "--compile.fsdp.keep_last_blocks", "12"],
     "fourth session"),
    ("8B TP2 (FSDP1xTP2), op SAC recompute", "llama3_8b.toml", 2, "h200",
     ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2",
      "--compile.sac.save", "recompute"], "TP2 (FSDP1xTP2) with SAC in effect"),
    ("1B DP2 (replicate 2), not measured", "llama3_1b.toml", 2, "h200",
     ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], "-"),
    ("seed: 8B FSDP4xTP2, 8 GPUs, op SAC recompute", "llama3_8b.toml", 8, "h100",
     ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2",
      "--compile.sac.save", "recompute"], "seventh session, Validation (the seed's and upstream's figures)"),
    ("seed layout, memory policy's plan", "llama3_8b.toml", 8, "h100",
     ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2"], "-"),
)
_MARK = "PROJECT_SCALE_RESULT "
_SHORT = {"all_gather_into_tensor": "AG", "reduce_scatter_tensor": "RS", "all_reduce": "AR"}


def grid(models: list[str], worlds: list[int], layouts: list[str]) -> list[tuple[str, int, str, list[str]]]:
    """``(model, world, layout name, flags)`` of every grid point; skipped points are
    ``(model, world, note, None)``."""
    out = []
    for m in models:
        for w in worlds:
            for lay in layouts:
                if lay == "fsdp":
                    out.append((m, w, f"FSDP{w}", ["--parallelism.data_parallel_shard_degree", str(w)]))
                elif lay == "fsdp_tp":
                    tp = TP_DEGREE[m]
                    out.append((m, w, f"FSDP{w // tp}xTP{tp}", ["--parallelism.data_parallel_shard_degree",
                                                                  str(w // tp), "--parallelism.tensor_parallel_degree",
                                                                  str(tp)]))
                else:
                    shard = HSDP_SHARD[m]
                    if w // shard < 2:
                        out.append((m, w, f"HSDP with FSDP groups of {shard}: one replica at {w} ranks "
                                          f"(the FSDP{w} row)", None))
                        continue
                    out.append((m, w, f"HSDP{w // shard}x{shard}", [
                        "--parallelism.data_parallel_replicate_degree", str(w // shard),
                        "--parallelism.data_parallel_shard_degree", str(shard)]))
    return out


#: Summaries of earlier runs (``--from-json``), by :func:`run_one`'s key.
CACHE: dict[str, dict] = {}


def run_one(config: str, flavor: str | None, world: int, flags: list[str], env: dict, timeout: int) -> dict:
    """One dry run in a subprocess; returns its summary (with ``"wall_s"`` and ``"key"``) or
    ``{"error": line}``; a summary of the same run in :data:`CACHE` is returned instead."""
    args = ["--job.config_file", os.path.basename(config), *flags] + (["--model.flavor", flavor] if flavor else [])
    key = json.dumps([args, world])
    if key in CACHE:
        return CACHE[key]
    args = ["--job.config_file", config, "--job.dump_folder", "/tmp/project_scale", *args[2:]]
    return {**_run(args, world, env, timeout), "key": key}


def _run(args: list[str], world: int, env: dict, timeout: int) -> dict:
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(args)], cwd=REPO, capture_output=True,
                           text=True, timeout=timeout, env={**env, "NGPU": str(world)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout}s"}
    wall = time.perf_counter() - t0
    for line in r.stdout.splitlines():
        if line.startswith(_MARK):
            return {**json.loads(line[len(_MARK):]), "wall_s": round(wall, 1)}
    tail = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
    err = next((ln for ln in reversed(tail) if ln.startswith("error:") or "Error" in ln), tail[-1] if tail else "?")
    return {"error": err.strip()[:200]}


def _one(args_json: str) -> int:
    """Child process: the dry run of ``args_json`` (a flag list); prints its summary as one line."""
    sys.path.insert(0, REPO)
    from graph_trainer.config import parse_args
    from graph_trainer.projection.dry_run import dry_run
    from graph_trainer.errors import UserError
    from graph_trainer.train import setup_logging

    setup_logging()
    try:
        s = dry_run(parse_args(json.loads(args_json)))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(_MARK + json.dumps(s, default=str), flush=True)
    return 0


def row(s: dict, gpus_per_node: int) -> dict:
    """The table cells of one dry-run summary."""
    p = s["projection"]
    gib = 2**30
    state = (s["param_bytes_per_rank"] + s["grad_bytes_per_rank"] + s["optimizer_bytes_per_rank"]) / gib
    pol = p["memory_policy"]
    save = pol["levers"].split("--compile.sac.save ")[1].split()[0] if "--compile.sac.save " in pol["levers"] else "-"
    colls = " · ".join(f"{_SHORT.get(c['kind'], c['kind'])} {c['dim']} {c['bytes'] / gib:.1f}"
                       for c in p["comm"] if c["bytes"] >= gib / 100)
    exposed: dict[str, float] = {}
    for c in p["comm"]:
        exposed[c["dim"]] = exposed.get(c["dim"], 0.0) + c["exposed_ms"]
    terms = p["compute_ms_by_term"]
    return {
        "layout": s["layout"], "ranks": f"{s['world_size']} ({max(1, s['world_size'] // gpus_per_node)})",
        "state": f"{state:.1f}", "peak": f"{pol['predicted_peak_gib']:.1f} ({save})"
        + ("" if pol["predicted_peak_gib"] <= pol["budget_gib"] else " over"),
        "colls": colls or "-",
        "compute": f"{p['compute_ms']:.0f} ({terms['matmul']:.0f}/{terms['attention']:.0f}/{terms['memory']:.0f}/"
                   f"{terms['optimizer']:.0f})",
        "exposed": f"{p['exposed_comm_ms']:.1f}" + (" (" + ", ".join(f"{d} {v:.1f}" for d, v in exposed.items()
                                                               if v >= 0.05) + ")" if p["exposed_comm_ms"] else ""),
        "step": f"{p['step_ms']:.0f}", "tps": f"{p['tps_per_gpu']:,.0f}", "mfu": f"{p['mfu_pct']:.1f}",
        "wall": f"{s.get('wall_s', 0):.0f}",
    }


COLUMNS = (("layout", "layout"), ("ranks", "ranks (nodes)"), ("state", "params+grads+AdamW GiB/rank"),
           ("peak", "predicted peak GiB (sac.save)"), ("colls", "collectives GiB/rank/step (kind, dim)"),
           ("compute", "compute ms (mm/attn/mem/opt)"), ("exposed", "exposed comm ms (by dim)"),
           ("step", "step ms"), ("tps", "tps/GPU"), ("mfu", "MFU %"), ("wall", "dry run s"))


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="8B,70B", help="comma list of 8B, 70B")
    p.add_argument("--worlds", default="8,64,512", help="comma list of rank counts")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of " + ", ".join(LAYOUTS))
    p.add_argument("--device", default=None, help="h100 | h200 (--projection.device; default h100, "
                                                  "--validate: each layout's own)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="--projection.gpus_per_node (default 8)")
    p.add_argument("--cost-constants", default="", help="--projection.cost_constants: a JSON file of "
                                                        "scripts/cost_constants.py (default: the committed one)")
    p.add_argument("--async-tp", action="store_true", help="--projection.async_tp: TP collectives overlap")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per dry run")
    p.add_argument("--json", default=None, help="also write every summary to this file")
    p.add_argument("--from-json", default=None, help="reuse the summaries of an earlier --json file (no dry run "
                                                      "for the points it holds)")
    p.add_argument("--validate", action="store_true", help="project the layouts measured in docs/perf_archive.md")
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one is not None:
        return _one(a.one)
    env = dict(os.environ)
    gpn = a.gpus_per_node
    if gpn < 1:
        print(f"error: --gpus-per-node must be a positive integer, got {gpn}", file=sys.stderr)
        return 2
    cost = os.path.abspath(a.cost_constants) if a.cost_constants else ""  # (the dry runs run in REPO)

    def projection_flags(device: str) -> list[str]:
        return (["--projection.device", device, "--projection.gpus_per_node", str(gpn)]
                + (["--projection.cost_constants", cost] if cost else [])
                + (["--projection.async_tp"] if a.async_tp else []))

    if a.from_json:
        with open(a.from_json) as f:
            CACHE.update({r["key"]: r for r in json.load(f) if "key" in r and "error" not in r})
    sys.path.insert(0, REPO)
    from graph_trainer.errors import UserError
    from graph_trainer.projection.devices import device_constants

    results = []
    if a.validate:
        rows, sources = [], {}
        for label, config, world, device, flags, ref in VALIDATION:
            try:
                dev = device_constants(a.device or device, cost)
            except UserError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            sources[dev.name] = dev.source
            s = run_one(os.path.join(REPO, "train_configs", config), None, world,
                        flags + projection_flags(dev.name), env, a.timeout)
            results.append({"case": label, **s})
            r = row(s, gpn) if "error" not in s else {"colls": s["error"]}
            r.update(layout=f"{label} [{ref}]", ranks=f"{world} x {dev.name.upper()}")
            rows.append(r)
            print(f"{label}: {r.get('tps', s.get('error'))}", file=sys.stderr, flush=True)
        print("\nprojected; constants: " + "; ".join(f"{k.upper()} {v}" for k, v in sources.items())
              + f"\n\n{table(rows)}")
    else:
        try:
            dev = device_constants(a.device or "h100", cost)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        models = [m.strip() for m in a.models.split(",") if m.strip()]
        layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
        bad = [m for m in models if m not in TP_DEGREE] + [x for x in layouts if x not in LAYOUTS]
        if bad:
            print(f"error: unknown --models / --layouts value(s): {', '.join(bad)}", file=sys.stderr)
            return 2
        worlds = [int(w) for w in a.worlds.split(",")]
        by_model: dict[str, list] = {m: [] for m in models}
        notes: dict[str, list] = {m: [] for m in models}
        for model, world, name, flags in grid(models, worlds, layouts):
            if flags is None:
                notes[model].append(name)
                continue
            s = run_one(CONFIG, model, world, flags + projection_flags(dev.name), env, a.timeout)
            results.append({"model": model, "name": name, **s})
            if "error" in s:
                notes[model].append(f"{name} on {world} ranks: not traced ({s['error']})")
                print(f"{model} {name}: {s['error']}", file=sys.stderr, flush=True)
                continue
            by_model[model].append(row(s, gpn))
            print(f"{model} {name}: {s['projection']['tps_per_gpu']:,.0f} tps/GPU ({s['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
        for m in models:
            print(f"\n### Llama3 {m} on {dev.name.upper()} nodes of {gpn} GPUs (constants: {dev.source})\n")
            print(table(by_model[m]))
            for n in notes[m]:
                print(f"\n* {n}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
