"""scripts/gpu/nvml_sampler.py: CSV rows in nvidia-smi's layout where NVML is, one error line and exit 2 where not."""

import ctypes
import signal
import subprocess
import sys

from _scripts import SCRIPTS


def test_samples_until_stopped_or_refuses_without_nvml():
    cmd = [sys.executable, str(SCRIPTS / "gpu" / "nvml_sampler.py"), "--interval-ms", "5"]
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stdout == ""
        assert r.stderr.startswith("nvml_sampler.py: error: no NVML here") and r.stderr.count("\n") == 1
        return
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = [p.stdout.readline() for _ in range(3)]  # the header (its handlers are set) and two rows: no sleep
    p.send_signal(signal.SIGTERM)
    lines = "".join(head + [p.communicate(timeout=30)[0]]).splitlines()
    assert p.returncode == 0 and lines[0].startswith("timestamp, clocks.current.sm [MHz]") and len(lines) > 2
    stamp, clock, power, reasons = (f.strip() for f in lines[1].split(","))
    assert clock.endswith(" MHz") and power.endswith(" W") and reasons.startswith("0x")
