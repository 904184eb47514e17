"""Checkpointing of the traced-step trainer through torchtitan's CheckpointManager (DCP).

Saved per checkpoint (``<dump_folder>/<checkpoint.folder>/step-N/``):

* ``model``: the trained tensors -- one rank: the model's fp32 parameters; FSDP and / or
  TP under ``aot_fx_trace``: each rank's local shards, under rank-specific keys
  (:class:`graph_trainer.distributed.fsdp.ShardedParams`), so DCP keeps every rank's part;
* ``optimizer`` and ``lr_scheduler`` (torchtitan's containers), ``dataloader``
  (torchtitan's stateful dataloader: position in the text stream, per DP rank);
* ``train_state``: the step and the layout it was saved with (:class:`TrainState`);
* ``rng_rank<r>``: Python, torch CPU and CUDA generator states of rank ``r``.

Atomicity: DCP writes ``.metadata`` last and torchtitan only loads ``step-N`` folders
that have it, so a save that is interrupted never replaces the last good checkpoint.
``graph_trainer_meta.json`` beside it records flavor, layout and mode; it is checked
before anything is loaded (:func:`check_resume_compatible`).

Every checkpoint, the last one included, holds the full training state (this project sets
``--checkpoint.last_save_model_only`` off), so rerunning a finished run's command finds it
complete and trains nothing, and a larger ``--training.steps`` continues from it. A
model-only checkpoint (written with ``--checkpoint.last_save_model_only``) is recognised
from its ``.metadata`` and refused with its name (:func:`is_model_only`). A complete
checkpoint of an earlier run at a step this run saves is moved aside to ``step-N.<K>``
(:func:`graph_trainer.metrics.keep_previous`), never written over.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
from dataclasses import dataclass, field

import torch

from graph_trainer.errors import UserError

logger = logging.getLogger("graph_trainer")

META_FILE = "graph_trainer_meta.json"


@dataclass
class TrainState:
    """Stateful training progress: the last completed ``step`` and the ``meta`` it ran with."""

    step: int = 0
    meta: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step), "meta": json.dumps(self.meta, sort_keys=True)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"])
        self.meta = json.loads(sd["meta"]) if isinstance(sd.get("meta"), str) else {}


class RNGState:
    """Stateful RNG of this rank: Python ``random``, torch CPU, and CUDA (if used)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        sd = {"python": pickle.dumps(random.getstate()), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            sd["cuda"] = torch.cuda.get_rng_state(self.device)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        random.setstate(pickle.loads(sd["python"]))
        torch.set_rng_state(sd["torch"].cpu())
        if "cuda" in sd and self.device.type == "cuda":
            torch.cuda.set_rng_state(sd["cuda"].cpu(), self.device)


def checkpoint_folder(cfg) -> str:
    return os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)


def latest_step(folder: str) -> int:
    """Largest ``N`` of a complete ``step-N`` checkpoint (``.metadata`` present), or -1."""
    if not os.path.isdir(folder):
        return -1
    steps = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    return max(steps, default=-1)


def check_resume_compatible(folder: str, step: int, meta: dict) -> None:
    """Refuse to resume from ``step-<step>`` if it was saved with another flavor, mode or
    layout, before anything is loaded.

    Raises:
        UserError: the recorded ``flavor`` / ``mode`` / ``layout`` differ from ``meta``
            (names the checkpoint and both values).
    """
    path = os.path.join(folder, f"step-{step}", META_FILE)
    if not os.path.isfile(path):
        logger.warning("checkpoint %s has no %s: cannot check flavor/layout before loading", path, META_FILE)
        return
    with open(path) as f:
        saved = json.load(f)
    for key in ("flavor", "mode", "layout"):
        if saved.get(key) != meta.get(key):
            what = {"flavor": "model flavor", "mode": "compile mode", "layout": "parallel layout"}[key]
            hint = (
                "Resharding a traced-FSDP checkpoint to another layout is not supported: resume with "
                f"the saved layout ({saved.get(key)})"
                if key == "layout"
                else f"Use --model.flavor/--compile.mode as saved ({saved.get(key)})"
            )
            raise UserError(
                f"Checkpoint {os.path.dirname(path)} was saved with {what} {saved.get(key)!r} but this run "
                f"uses {meta.get(key)!r}. {hint}, or point --checkpoint.folder / --job.dump_folder elsewhere."
            )


def verify_checkpoint_files(ckpt: str):
    """Check that every data file a DCP checkpoint's ``.metadata`` refers to exists and
    is long enough (catches truncated copies and interrupted writes of data files).

    Returns:
        The checkpoint's DCP ``Metadata``.

    Raises:
        UserError: unreadable ``.metadata``, or a missing / truncated data file (named).
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(ckpt).read_metadata()
    except Exception as e:
        raise UserError(
            f"Checkpoint {ckpt}: {os.path.join(ckpt, '.metadata')} is unreadable ({type(e).__name__}: {e}); "
            "the checkpoint is corrupt."
        ) from None
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        path = getattr(info, "relative_path", None)
        if path is not None:
            need[path] = max(need.get(path, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        path = os.path.join(ckpt, rel)
        if not os.path.isfile(path):
            raise UserError(f"Checkpoint {ckpt} is incomplete: data file {path} is missing.")
        have = os.path.getsize(path)
        if have < size:
            raise UserError(
                f"Checkpoint {ckpt} is truncated: data file {path} has {have} bytes, its metadata "
                f"needs {size}."
            )
    return md


def require_complete(folder: str, step: int) -> None:
    """Check that ``--checkpoint.load_step step`` names a complete checkpoint in ``folder``.

    Raises:
        UserError: ``step-<step>`` does not exist or its save did not finish (no ``.metadata``);
            names the latest complete one.
    """
    ckpt = os.path.join(folder, f"step-{step}")
    if not os.path.isfile(os.path.join(ckpt, ".metadata")):
        what = "is incomplete (no .metadata: its save did not finish)" if os.path.isdir(ckpt) else "does not exist"
        have = latest_step(folder)
        raise UserError(f"--checkpoint.load_step {step}: checkpoint {ckpt} {what}. "
                        + (f"The latest complete one is step-{have}." if have > 0 else "No complete one exists."))


def is_model_only(md) -> bool:
    """True when the DCP ``Metadata`` ``md`` (``FileSystemReader(path).read_metadata()``)
    is a model-only checkpoint: it lists no ``train_state`` (torchtitan's
    ``--checkpoint.last_save_model_only`` saves the model's tensors alone)."""
    return not any(k == "train_state" or k.startswith("train_state.") for k in md.state_dict_metadata)


def _full_steps(folder: str, below: int) -> list[int]:
    """Steps ``< below`` of complete, readable checkpoints in ``folder`` that can resume
    training (not model-only), ascending."""
    from torch.distributed.checkpoint import FileSystemReader

    out = []
    for s in range(below):
        ckpt = os.path.join(folder, f"step-{s}")
        if os.path.isfile(os.path.join(ckpt, ".metadata")):
            try:
                if not is_model_only(FileSystemReader(ckpt).read_metadata()):
                    out.append(s)
            except Exception:  # an unreadable one is no resume point
                pass
    return out


def _first_cause(e: BaseException) -> BaseException:
    """The first real exception inside DCP's ``CheckpointException`` (its ``failures``
    map ranks to ``(exception, traceback summary)`` pairs), else ``e``."""
    for _ in range(4):  # nested CheckpointExceptions
        failures = getattr(e, "failures", None)
        if not failures:
            break
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    return e


class Checkpointer:
    """torchtitan's ``CheckpointManager`` plus the checks above. ``enabled`` is False when
    ``--checkpoint.enable`` is off (then every method is a no-op)."""

    def __init__(self, cfg, dataloader, model_part, optimizers, lr_schedulers, device, rank: int, meta: dict):
        from torchtitan.components.checkpoint import CheckpointManager

        self.enabled = bool(cfg.checkpoint.enable)
        import torch.distributed as dist

        if self.enabled and not dist.is_initialized():  # DCP needs a process group, even of 1
            from graph_trainer.distributed.parallelize import _init_single_process_group

            _init_single_process_group(device)
        self.folder = checkpoint_folder(cfg)
        self.rank = rank
        self.meta = meta
        self.train_state = TrainState(0, meta)
        states = {"train_state": self.train_state, f"rng_rank{rank}": RNGState(device)}
        self.manager = CheckpointManager(
            dataloader=dataloader,
            model_parts=[model_part],
            optimizers=optimizers,
            lr_schedulers=lr_schedulers,
            states=states,
            checkpoint_config=cfg.checkpoint,
            sd_adapter=None,
            base_folder=cfg.job.dump_folder,
        )

    def load_latest(self, load_step: int = -1) -> int:
        """Load ``step-<load_step>`` (-1: the latest complete one). Returns the step
        loaded (0 when there is nothing to resume).

        Raises:
            UserError: ``--checkpoint.load_step`` names no complete checkpoint; an
                incompatible checkpoint (see :func:`check_resume_compatible`); a model-only
                one (``--checkpoint.last_save_model_only``), which cannot resume training; a
                truncated / corrupt one (names the folder and the first error DCP raised).
                Each names the older checkpoint to resume from instead; all are left in place.
        """
        if not self.enabled:
            return 0
        step = latest_step(self.folder) if load_step == -1 else load_step
        if step <= 0:
            return 0
        ckpt = os.path.join(self.folder, f"step-{step}")
        require_complete(self.folder, step)  # only an explicit load_step can name an incomplete one
        check_resume_compatible(self.folder, step, self.meta)

        def hint() -> str:
            older = _full_steps(self.folder, step)
            where = "point --job.dump_folder / --checkpoint.folder elsewhere to start over."
            if older:
                return f"resume from step-{older[-1]} with --checkpoint.load_step {older[-1]}, or {where}"
            return f"no older checkpoint in {self.folder} can resume training: {where}"

        try:
            md = verify_checkpoint_files(ckpt)
        except UserError as e:
            raise UserError(f"{e} It is left in place; {hint()}") from None
        if is_model_only(md):
            raise UserError(f"Checkpoint {ckpt} holds only the model (--checkpoint.last_save_model_only): "
                            f"it cannot resume training; {hint()}")
        try:
            self.manager.load(step=step)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            cause = _first_cause(e)
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
            raise UserError(
                f"Checkpoint {ckpt} could not be loaded ({type(cause).__name__}: {first}); it may be truncated "
                f"or corrupt. It is left in place; {hint()}"
            ) from None
        logger.info("Resumed from %s (step %d)", ckpt, self.train_state.step)
        return self.train_state.step

    def save(self, step: int, last_step: bool) -> None:
        """Save at ``step`` if torchtitan's policy says so (interval / last step). A complete
        ``step-<step>`` of an earlier run is moved aside first (rank 0), never written over.

        Raises:
            UserError: that earlier checkpoint cannot be moved aside (names it).
        """
        if not self.enabled:
            return
        self.train_state.step = step
        if self.manager._should_save(step, last_step):
            self._keep_earlier(os.path.join(self.folder, f"step-{step}"))
        self.manager.save(step, last_step=last_step)
        ckpt = os.path.join(self.folder, f"step-{step}")
        if self.rank == 0 and os.path.isfile(os.path.join(ckpt, ".metadata")):
            with open(os.path.join(ckpt, META_FILE), "w") as f:
                json.dump({**self.meta, "step": step}, f, indent=1, sort_keys=True)

    def _keep_earlier(self, ckpt: str) -> None:
        import torch.distributed as dist

        from graph_trainer.metrics import keep_previous

        if self.rank == 0 and os.path.isfile(os.path.join(ckpt, ".metadata")):
            try:
                kept = keep_previous(ckpt)
            except OSError as e:
                raise UserError(f"Cannot move the earlier checkpoint {ckpt} aside before saving this step "
                                f"({e.strerror or e}); it was not written over.") from None
            logger.info("An earlier run's checkpoint %s is kept as %s", ckpt, kept)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # no rank writes into the folder before it is moved
            dist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)

    def close(self) -> None:
        """Stop torchtitan's checkpoint threads (no-op when disabled)."""
        if self.enabled:
            self.manager.close()


__all__ = ["Checkpointer", "TrainState", "RNGState", "check_resume_compatible", "is_model_only", "latest_step",
           "require_complete", "verify_checkpoint_files"]
