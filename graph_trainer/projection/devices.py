"""Device constants of the scale projection (:mod:`graph_trainer.projection.cost_model`).

One :class:`DeviceConstants` per GPU kind of ``--projection.device``: vendor datasheet values
until ``scripts/cost_constants.py`` has measured them on the GPU and written a JSON file; the
file ``graph_trainer/projection/cost_constants/<device>.json`` (or the one
``--projection.cost_constants`` names) replaces the defaults field by field, and the
projection says which fields were measured (docs/design.md, "Scale projection: the cost model";
the measurements: docs/perf.md, "scale projection").
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from graph_trainer.errors import UserError

#: The device kinds ``--projection.device`` accepts.
DEVICES = ("h100", "h200")
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_constants")


@dataclass(frozen=True)
class Link:
    """One link type's α–β constants.

    Attributes:
        alpha_s: latency per collective, seconds.
        busbw_Bps: bus bandwidth, bytes/s (nccl-tests' busbw: one direction, per GPU).
        by_kind: ``{collective kind: (alpha_s, busbw_Bps)}`` measured per kind; kinds not
            in it use ``alpha_s`` / ``busbw_Bps``.
    """

    alpha_s: float
    busbw_Bps: float
    by_kind: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def constants(self, kind: str) -> tuple[float, float]:
        """``(alpha_s, busbw_Bps)`` for collective ``kind``."""
        return tuple(self.by_kind.get(kind, (self.alpha_s, self.busbw_Bps)))


@dataclass(frozen=True)
class DeviceConstants:
    """Throughputs of one GPU kind. Rates in FLOP/s and bytes/s, sizes in GiB.

    Attributes:
        name: ``"h100"`` / ``"h200"``.
        peak_bf16_flops: dense bf16 peak, the MFU denominator (``graph_trainer.metrics``).
        matmul_flops: bf16 matmul rate for shapes not in ``matmul_by_shape``.
        attention_flops: causal SDPA forward + backward rate (FLOPs counted as
            :func:`graph_trainer.projection.cost_model.node_flops` counts them) for shapes not
            in ``attention_by_shape``.
        hbm_Bps: memory bandwidth, bytes read + written per second.
        nvlink: the link inside a node.
        nic: one GPU's network link (the NIC of a GPU, rail-optimized).
        memory_gib: device memory the dry run's memory policy plans for.
        matmul_by_shape: ``{sorted (M, N, K): FLOP/s}`` measured.
        attention_by_shape: ``{(B, H, S, D): FLOP/s}`` measured (H: query heads).
        measured: the fields a measurement file set.
        source: where the values came from (printed with the projection).
    """

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


def _defaults(name: str, gpu: str, hbm_Bps: float, memory_gib: float) -> DeviceConstants:
    """Vendor datasheet values (NVIDIA H100 / H200 SXM data sheets): dense bf16 peak for the
    matmul and attention rates (no efficiency applied), HBM bandwidth, NVLink 4 at 900 GB/s
    bidirectional = 450 GB/s per direction, ConnectX-7 400 Gb/s = 50 GB/s per GPU. The α
    values are assumptions (no datasheet gives them): 10 µs inside a node, 20 µs across."""
    from graph_trainer.metrics import peak_bf16_for_name

    peak = peak_bf16_for_name(gpu)
    return DeviceConstants(name=name, peak_bf16_flops=peak, matmul_flops=peak, attention_flops=peak,
                           hbm_Bps=hbm_Bps, nvlink=Link(10e-6, 450e9), nic=Link(20e-6, 50e9), memory_gib=memory_gib)


def _default_devices() -> dict[str, DeviceConstants]:
    from graph_trainer.compiler.memory_policy import DRY_RUN_DEVICES_GIB

    return {
        "h100": _defaults("h100", "H100", 3.35e12, DRY_RUN_DEVICES_GIB[0]),
        "h200": _defaults("h200", "H200", 4.8e12, DRY_RUN_DEVICES_GIB[1]),
    }


def device_constants(name: str, path: str = "") -> DeviceConstants:
    """The constants of device kind ``name``: datasheet defaults, with every field that the
    measurement file sets replaced.

    Args:
        name: ``"h100"`` or ``"h200"`` (case-insensitive; ``--projection.device``).
        path: a JSON file written by ``scripts/cost_constants.py`` (``--projection.cost_constants``);
            empty: ``graph_trainer/projection/cost_constants/<name>.json`` if it exists, else none.

    Raises:
        UserError: unknown ``name``; the file is missing, not JSON, or measured another GPU.
    """
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
    """``dev`` with the fields measured in ``data`` (the JSON of ``scripts/cost_constants.py``:
    ``device``, ``matmul`` rows ``{m, n, k, tflops}``, ``matmul_tflops``, ``attention`` rows
    ``{b, h, s, d, tflops}``, ``attention_tflops``, ``hbm_gbps``, ``nccl``
    ``{kind: {alpha_us, busbw_gbps}}`` measured inside one node, ``nccl_network`` the same
    measured across nodes with ``gpus_per_node`` each). TFLOP/s and GB/s in the file;
    FLOP/s, bytes/s and seconds in the result.

    Raises:
        UserError: ``data["device"]`` names another GPU than ``dev``.
    """
    gpu = str(data.get("device", ""))
    if gpu and dev.name.upper() not in gpu.upper():
        raise UserError(f"--projection.cost_constants {path} was measured on {gpu!r}, not an {dev.name.upper()}.")
    upd, measured = {}, []
    if data.get("matmul_tflops"):
        upd["matmul_flops"] = data["matmul_tflops"] * 1e12
        upd["matmul_by_shape"] = {tuple(sorted((r["m"], r["n"], r["k"]))): r["tflops"] * 1e12
                                  for r in data.get("matmul", [])}
        measured.append("matmul")
    if data.get("attention_tflops"):
        upd["attention_flops"] = data["attention_tflops"] * 1e12
        upd["attention_by_shape"] = {(r["b"], r["h"], r["s"], r["d"]): r["tflops"] * 1e12
                                     for r in data.get("attention", [])}
        measured.append("attention")
    if data.get("hbm_gbps"):
        upd["hbm_Bps"] = data["hbm_gbps"] * 1e9
        measured.append("hbm")
    nccl = {k: (v["alpha_us"] * 1e-6, v["busbw_gbps"] * 1e9) for k, v in (data.get("nccl") or {}).items()}
    if nccl:
        # the NVLink default for kinds not measured: the mean of the measured ones
        alpha = sum(a for a, _ in nccl.values()) / len(nccl)
        beta = sum(b for _, b in nccl.values()) / len(nccl)
        upd["nvlink"] = Link(alpha, beta, nccl)
        measured.append("nvlink")
    net = data.get("nccl_network") or {}
    if net:  # measured across hosts with k GPUs each: k NICs at once (cost_model's docstring), per NIC / k
        alpha = sum(v["alpha_us"] * 1e-6 for v in net.values()) / len(net)
        beta = sum(v["busbw_gbps"] * 1e9 / v.get("gpus_per_node", 1) for v in net.values()) / len(net)
        upd["nic"] = Link(alpha, beta)
        measured.append("nic")
    if not measured:
        return dev
    return dataclasses.replace(dev, **upd, measured=tuple(measured),
                               source=f"measured ({', '.join(measured)}) in {os.path.basename(path)}, "
                                      "the rest datasheet defaults")
