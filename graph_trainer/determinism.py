"""Seeding, deterministic kernels, and hashes of the training state.

``--debug.seed N`` and ``--debug.deterministic`` (torchtitan's ``[debug]`` fields)
are applied by :func:`apply_determinism` before the model is built;
``--debug.state_hashes`` makes the trainer record :func:`state_hashes` at the end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random

import torch

logger = logging.getLogger("graph_trainer")


def apply_determinism(seed: int | None, deterministic: bool, warn_only: bool = False) -> dict:
    """Seed every RNG and, with ``deterministic``, select deterministic kernels.

    Seeds Python's ``random``, NumPy (when installed), torch's CPU and all CUDA
    generators with ``seed`` (``None``: 0, so runs are reproducible by default) and sets
    ``PYTHONHASHSEED`` for child processes. The dataloader needs no seed: the text
    datasets are read in order (torchtitan's ``HuggingFaceTextDataset``, no shuffling).

    With ``deterministic``:

    * ``torch.use_deterministic_algorithms(True, warn_only=warn_only)`` -- ops without
      a deterministic implementation raise (or warn);
    * ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (needed by cuBLAS for deterministic results;
      set before the first cuBLAS handle is created);
    * ``torch.backends.cudnn.deterministic = True``, ``cudnn.benchmark = False``;
    * Inductor's deterministic mode where the installed torch has it
      (``torch._inductor.config.deterministic``, plus ``TORCHINDUCTOR_DETERMINISTIC=1``
      for subprocess compiles): no autotuning choices that depend on timing.

    Returns what was set, e.g. ``{"seed": 0, "deterministic": True,
    "inductor_deterministic": True}``.
    """
    seed = 0 if seed is None else int(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    os.environ["PYTHONHASHSEED"] = str(seed % 2**32)
    applied = {"seed": seed, "deterministic": bool(deterministic), "inductor_deterministic": None}
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        import torch._inductor.config as inductor_config

        if hasattr(inductor_config, "deterministic"):
            inductor_config.deterministic = True
            os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
            applied["inductor_deterministic"] = True
        else:  # pragma: no cover - older torch
            applied["inductor_deterministic"] = False
            logger.warning("this torch has no torch._inductor.config.deterministic; Inductor may autotune")
        logger.info("Deterministic mode: %s", applied)
    return applied


def _one_sha256(t) -> bytes:
    if t is None:
        return b"none"
    if hasattr(t, "to_local"):  # DTensor (eager FSDP2 / TP): this rank's shard, no collective
        t = t.to_local()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    t = t.detach().reshape(-1).contiguous().cpu()
    if t.numel():
        h.update(t.view(torch.uint8).numpy())  # hashlib releases the GIL on large buffers
    return h.digest()


def tensor_sha256(tensors, threads: int = 8) -> str:
    """sha256 over the per-tensor sha256 digests of ``tensors`` (raw bytes, dtype, shape), in order.

    Bitwise identity of two tensor lists <=> equal digests (up to sha256 collisions).
    Tensors are copied to CPU one at a time per thread and hashed on ``threads`` threads
    (hashlib releases the GIL, so the threads hash in parallel; the time for the 8B state:
    docs/perf.md, section "8B, 20 steps: traced (SAC in effect) tracks eager FSDP2"); at
    most ``threads`` host copies exist at once.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        digests = list(pool.map(_one_sha256, list(tensors)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def state_hashes(params, optimizer_states, group=None) -> dict[str, str]:
    """``{"weights", "grads", "optimizer"}`` sha256 digests of this run's final state.

    ``params``: the trained tensors (FSDP: the local shards; DTensors, as eager FSDP2 and TP
    hold them, are hashed through ``to_local()``); ``optimizer_states``:
    the optimizer tensors (AdamW ``exp_avg`` / ``exp_avg_sq`` / ``step``) in a fixed
    order. With several ranks each rank hashes its own part and the result is the
    sha256 of the per-rank digests in rank order (same on every rank): equal layouts
    compare bit for bit.
    """
    local = {
        "weights": tensor_sha256(params),
        "grads": tensor_sha256([p.grad for p in params]),
        "optimizer": tensor_sha256(optimizer_states),
    }
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return {k: hashlib.sha256("".join(g[k] for g in gathered).encode()).hexdigest() for k in local}


def optimizer_tensors(optimizers, params) -> list[torch.Tensor]:
    """The optimizer state tensors of ``params`` in parameter order (sorted keys)."""
    out = []
    for opt in optimizers:
        for p in params:
            st = opt.state.get(p, {})
            out.extend(st[k] if isinstance(st[k], torch.Tensor) else torch.tensor(st[k]) for k in sorted(st))
    return out
