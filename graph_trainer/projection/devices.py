"""Device constants of the scale projection (:mod:`graph_trainer.projection.cost_model`): datasheet
values, replaced field by field by the JSON that ``scripts/cost_constants.py`` measured
(``graph_trainer/projection/cost_constants/<device>.json`` or ``--projection.cost_constants``)."""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from graph_trainer.compiler.memory_policy import DRY_RUN_DEVICES_GIB
from graph_trainer.errors import UserError
from graph_trainer.metrics import peak_bf16_for_name

#: The device kinds ``--projection.device`` accepts.
DEVICES = ("h100", "h200")
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_constants")


@dataclass(frozen=True)
class Link:
    """One link type's α–β constants: latency ``alpha_s`` (s), nccl-tests' bus bandwidth
    ``busbw_Bps`` (bytes/s, one direction per GPU), ``by_kind``: ``{kind: (alpha_s, busbw_Bps)}`` measured."""

    alpha_s: float
    busbw_Bps: float
    by_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def constants(self, kind: str) -> tuple[float, float]:
        return tuple(self.by_kind.get(kind, (self.alpha_s, self.busbw_Bps)))


@dataclass(frozen=True)
class DeviceConstants:
    """Throughputs of one GPU kind, in FLOP/s and bytes/s (read + written); ``peak_bf16_flops`` is
    the MFU denominator; ``matmul_flops`` / ``attention_flops`` (causal SDPA forward + backward) the
    rates of shapes not in ``matmul_by_shape`` ``{sorted (M, N, K): FLOP/s}`` / ``attention_by_shape``
    ``{(B, H, S, D): FLOP/s}``; ``nic``: one GPU's network link; ``memory_gib``: what the dry run's
    memory policy plans for; ``measured``: the fields a measurement file set."""

    name: str
    peak_bf16_flops: float
    matmul_flops: float
    attention_flops: float
    hbm_Bps: float
    nvlink: Link
    nic: Link
    memory_gib: float
    matmul_by_shape: Mapping[tuple, float] = field(default_factory=dict)
    attention_by_shape: Mapping[tuple, float] = field(default_factory=dict)
    measured: tuple[str, ...] = ()
    source: str = "datasheet defaults"


def _default_devices() -> dict[str, DeviceConstants]:
    """NVIDIA H100 / H200 SXM datasheets: dense bf16 peak as matmul and attention rate, HBM,
    NVLink 4 at 450 GB/s per direction, ConnectX-7 at 50 GB/s per GPU; α assumed (10 µs / 20 µs)."""
    out = {}
    for name, hbm_Bps, memory_gib in zip(DEVICES, (3.35e12, 4.8e12), DRY_RUN_DEVICES_GIB):
        peak = peak_bf16_for_name(name.upper())
        out[name] = DeviceConstants(name, peak, peak, peak, hbm_Bps, Link(10e-6, 450e9), Link(20e-6, 50e9), memory_gib)
    return out


def device_constants(name: str, path: str = "") -> DeviceConstants:
    """The constants of device kind ``name`` (``h100`` | ``h200``): datasheet defaults with the fields measured in
    ``path`` (a JSON of ``scripts/cost_constants.py``; empty: ``cost_constants/<name>.json`` if it exists) replaced.
    Raises UserError: unknown ``name``; the file is missing, not JSON, or measured another GPU."""
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in DEVICES:
        raise UserError(f"--projection.device {name!r} is not known; use one of {', '.join(DEVICES)}.")
    dev = _default_devices()[key]
    if not path:
        path = os.path.join(_HERE, f"{key}.json")
        if not os.path.exists(path):
            return dev
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--projection.cost_constants {path}: cannot read a JSON file ({e}).") from None
    if not isinstance(data, dict):
        raise UserError(f"--projection.cost_constants {path}: not a JSON object of scripts/cost_constants.py.")
    return apply_measurements(dev, data, path)


def apply_measurements(dev: DeviceConstants, data: dict, path: str = "<dict>") -> DeviceConstants:
    """``dev`` with the fields measured in ``data`` (the JSON of ``scripts/cost_constants.py``, in TFLOP/s, GB/s and
    µs): ``matmul_tflops`` and rows ``{m, n, k, tflops}``, ``attention_tflops`` and rows ``{b, h, s, d, tflops}``,
    ``hbm_gbps``, ``nccl`` / ``nccl_network`` ``{kind: {alpha_us, busbw_gbps[, gpus_per_node]}}`` inside one node /
    across nodes. Raises UserError: ``data["device"]`` names another GPU than ``dev``."""
    gpu = str(data.get("device", ""))
    if gpu and dev.name.upper() not in gpu.upper():
        raise UserError(f"--projection.cost_constants {path} was measured on {gpu!r}, not an {dev.name.upper()}.")
    upd, measured = {}, []
    for term, cols in (("matmul", "mnk"), ("attention", "bhsd")):
        if data.get(f"{term}_tflops"):
            upd[f"{term}_flops"] = data[f"{term}_tflops"] * 1e12
            rows = [(tuple(r[c] for c in cols), r["tflops"] * 1e12) for r in data.get(term, [])]
            upd[f"{term}_by_shape"] = {tuple(sorted(k)) if term == "matmul" else k: v for k, v in rows}
            measured.append(term)
    if data.get("hbm_gbps"):
        upd["hbm_Bps"] = data["hbm_gbps"] * 1e9
        measured.append("hbm")
    nccl = {k: (v["alpha_us"] * 1e-6, v["busbw_gbps"] * 1e9) for k, v in (data.get("nccl") or {}).items()}
    if nccl:  # kinds not measured: the mean of the measured ones
        upd["nvlink"] = Link(*(sum(x) / len(nccl) for x in zip(*nccl.values())), nccl)
        measured.append("nvlink")
    net = data.get("nccl_network") or {}
    if net:  # measured across hosts with k GPUs each: k NICs at once (cost_model's docstring), per NIC / k
        alpha = sum(v["alpha_us"] * 1e-6 for v in net.values()) / len(net)
        beta = sum(v["busbw_gbps"] * 1e9 / v.get("gpus_per_node", 1) for v in net.values()) / len(net)
        upd["nic"] = Link(alpha, beta)
        measured.append("nic")
    if not measured:
        return dev
    return replace(dev, **upd, measured=tuple(measured),
                   source=f"measured ({', '.join(measured)}) in {os.path.basename(path)}, the rest datasheet defaults")
