"""Seeding, deterministic kernels (``--debug.seed``, ``--debug.deterministic``, applied before the
model is built) and sha256 of the training state (``--debug.state_hashes``)."""

import hashlib
import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from graph_trainer import logger

_PINNED = threading.local()  # the hashing threads' pinned staging buffers


def apply_determinism(seed: int | None, deterministic: bool, warn_only: bool = False) -> dict:
    """Seed Python, NumPy, torch CPU and CUDA with ``seed`` (None: 0) and ``PYTHONHASHSEED``; with ``deterministic``
    also deterministic algorithms, cuBLAS workspace, cuDNN and Inductor's deterministic mode. Returns what was set, e.g.
    ``{"seed": 0, "deterministic": True, "inductor_deterministic": True}``."""
    seed = 0 if seed is None else int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed % 2**32)
    applied = {"seed": seed, "deterministic": bool(deterministic), "inductor_deterministic": None}
    if deterministic:
        import torch._inductor.config as inductor_config

        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS handle
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        applied["inductor_deterministic"] = hasattr(inductor_config, "deterministic")
        if applied["inductor_deterministic"]:
            inductor_config.deterministic = True
            os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
        else:  # pragma: no cover - older torch
            logger.warning("this torch has no torch._inductor.config.deterministic; Inductor may autotune")
        logger.info("Deterministic mode: %s", applied)
    return applied


def _one_sha256(t, chunk: int = 64 * 2**20) -> bytes:
    if t is None:
        return b"none"
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor (eager FSDP2 / TP): this rank's shard, no collective
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    t = t.detach().reshape(-1).contiguous().view(torch.uint8)
    if t.is_cuda and len(getattr(_PINNED, "buf", ())) < chunk:  # pageable device-to-host copies run far below pinned
        _PINNED.buf = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    for i in range(0, t.numel(), chunk):  # hashlib releases the GIL on large buffers
        part = t[i : i + chunk]
        h.update((_PINNED.buf[: part.numel()].copy_(part) if t.is_cuda else part.cpu()).numpy())
    return h.digest()


def tensor_sha256(tensors, threads: int = 8) -> str:
    """sha256 over the per-tensor sha256 digests (bytes, dtype, shape) of ``tensors``, in order:
    equal digests <=> bitwise-equal lists. Hashed on ``threads`` threads, at most that many host copies."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = list(pool.map(_one_sha256, list(tensors)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def state_hashes(params, optimizers, view=None, group=None) -> dict[str, str]:
    """``{"weights", "grads", "optimizer"}`` sha256 digests of ``params`` (local shards), their grads and the
    ``optimizers``' state of them; ``view(i, t)``: ``t`` shaped like param ``i`` as hashed (FSDP2's local shape, so
    traced and eager hash equal states equally). A DTensor gradient is hashed in its parameter's placements (eager
    TP's partial and replicated ones: a collective, on every rank in order). Several ranks: the sha256 of the per-rank
    digests in rank order."""
    view = view or (lambda i, t: t)
    placed = [p.grad.redistribute(p.device_mesh, p.placements) if hasattr(p.grad, "placements")
              and p.grad.placements != p.placements else p.grad for p in params]
    local = {"weights": tensor_sha256([view(i, p) for i, p in enumerate(params)]),
             "grads": tensor_sha256([None if g is None else view(i, g) for i, g in enumerate(placed)]),
             "optimizer": tensor_sha256(optimizer_tensors(optimizers, params, view))}
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return {k: hashlib.sha256("".join(g[k] for g in gathered).encode()).hexdigest() for k in local}


def optimizer_tensors(optimizers, params, view=None) -> list[torch.Tensor]:
    """The optimizer state tensors of ``params`` in parameter order (sorted keys), each through
    ``view(i, t)`` (param ``i``) if given."""
    out = []
    for opt in optimizers:
        for i, p in enumerate(params):
            st = opt.state.get(p, {})
            ts = (st[k] if isinstance(st[k], torch.Tensor) else torch.tensor(st[k]) for k in sorted(st))
            out.extend(view(i, t) if view else t for t in ts)
    return out
