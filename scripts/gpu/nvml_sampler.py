#!/usr/bin/env python3
"""Sample GPU 0's SM clock, power and clock-event reasons through NVML every ``--interval-ms``
until stopped (SIGTERM / SIGINT), as CSV in ``nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,
clocks_event_reasons.active --format=csv``'s layout, but finer than ``nvidia-smi -lms`` allows: run
it beside a bench call to see whether the SM clock throttles under a mode. NVML through ctypes
(``libnvidia-ml.so.1``, the driver's): no Python package needed. Power: ``nvmlDeviceGetPowerUsage``
(the driver's own averaging window).

    python3 scripts/gpu/nvml_sampler.py --interval-ms 10 > smi.csv &
"""

import argparse
import ctypes
import datetime
import signal
import sys
import time

NVML_CLOCK_SM = 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval-ms", type=float, default=10.0, help="sampling period in ms (default 10)")
    p.add_argument("--index", type=int, default=0, help="the GPU's NVML index (default 0)")
    args = p.parse_args()
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        print(f"nvml_sampler.py: error: no NVML here ({e})", file=sys.stderr)
        return 2
    handle, clock, power, reasons = ctypes.c_void_p(), ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
    if nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(args.index, ctypes.byref(handle)):
        print(f"nvml_sampler.py: error: NVML could not open GPU {args.index}", file=sys.stderr)
        return 2
    reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    print("timestamp, clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active", flush=True)
    while not stop:
        nvml.nvmlDeviceGetClockInfo(handle, NVML_CLOCK_SM, ctypes.byref(clock))
        nvml.nvmlDeviceGetPowerUsage(handle, ctypes.byref(power))
        reasons_fn(handle, ctypes.byref(reasons))
        now = datetime.datetime.now().strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        print(f"{now}, {clock.value} MHz, {power.value / 1000:.2f} W, 0x{reasons.value:016x}", flush=True)
        time.sleep(args.interval_ms / 1e3)
    nvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
