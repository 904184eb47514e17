"""Launch by launch, one profiled step of a run: the kernels whose names hold each PATTERN, grouped
by name, grid and block (time, launches, mean), and the gaps on the device (no kernel, copy or memset
running) longer than --gap-us, with the kernels on either side and the CPU calls that span the
three longest.

    python3 scripts/gpu/launches.py RUN_DIR/profile_traces/iteration_8/rank0_trace.json \\
        triton_poi_fused__to_copy bfloat16_copy_kernel

The trace is the profiler's Chrome trace (``--profiling.enable_profiling``); grid and block are the
launch's as the trace records them (``args``). A missing or unreadable trace: one line, exit 2.
"""

import argparse
import collections
import json
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="rank<r>_trace.json of one profiled step")
    ap.add_argument("patterns", nargs="*", help="substrings of kernel names to group by launch shape")
    ap.add_argument("--gap-us", type=float, default=30.0, help="shortest gap listed, microseconds (default 30)")
    args = ap.parse_args()
    try:
        events = json.load(open(args.trace))["traceEvents"]
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.trace}: not a profiler trace ({type(e).__name__}: {e})", file=sys.stderr)
        sys.exit(2)
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    kernels = [e for e in device if e["cat"] == "kernel"]
    for pat in args.patterns:
        groups = collections.defaultdict(list)
        for e in (e for e in kernels if pat in e["name"]):
            a = e.get("args", {})
            groups[(e["name"][:60], str(a.get("grid")), str(a.get("block")))].append(e["dur"])
        total = sum(sum(v) for v in groups.values())
        print(f"== {pat}: {sum(map(len, groups.values()))} launches, {total / 1e3:.2f} ms")
        for (name, grid, block), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:14]:
            print(f"  {sum(durs) / 1e3:7.3f} ms  n={len(durs):4d}  mean {sum(durs) / len(durs):8.1f} us  "
                  f"grid {grid} block {block}  {name}")
    if not device:
        return
    t0, end, gaps = device[0]["ts"], device[0]["ts"] + device[0]["dur"], []
    for a, b in zip(device, device[1:]):
        end = max(end, a["ts"] + a["dur"])
        if b["ts"] - end > args.gap_us:
            gaps.append((b["ts"] - end, b["ts"] - t0, a["name"][:70], b["name"][:70]))
    span = max(e["ts"] + e["dur"] for e in device) - t0
    print(f"== device span {span / 1e3:.2f} ms, {len(device)} kernels / copies; {len(gaps)} gaps > "
          f"{args.gap_us:g} us, {sum(g[0] for g in gaps) / 1e3:.2f} ms in all")
    for gap, at, before, after in sorted(gaps, reverse=True)[:25]:
        print(f"  {gap:8.1f} us at {at / 1e3:8.2f} ms: after {before} | before {after}")
    cpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")]
    for gap, at, _, _ in sorted(gaps, reverse=True)[:3]:
        t1 = t0 + at
        spanning = sorted({e["name"][:60] for e in cpu if e["ts"] < t1 and e["ts"] + e["dur"] > t1 - gap
                           and e["dur"] > gap / 2})
        print(f"  CPU during the {gap:.0f} us gap: {', '.join(spanning[:12])}")


if __name__ == "__main__":
    main()
