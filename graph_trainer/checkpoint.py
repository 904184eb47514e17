"""Checkpoints through torchtitan's CheckpointManager (DCP), plus the checks it lacks.

``<dump_folder>/<checkpoint.folder>/step-N/`` holds the states and ``graph_trainer_meta.json`` (flavor, mode, layout;
checked before loading). DCP writes ``.metadata`` last and only such folders are loaded, so an interrupted save never
replaces the last good one."""

import contextlib
import json
import os
import pickle
import random
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from graph_trainer import logger
from graph_trainer.distributed.parallelize import _init_single_process_group
from graph_trainer.errors import UserError
from graph_trainer.metrics import keep_previous

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
    """Stateful RNG of this rank (Python ``random``, torch CPU and CUDA); torchtitan saves none."""

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


def _complete(folder: str, step: int) -> bool:
    return os.path.isfile(os.path.join(folder, f"step-{step}", ".metadata"))


def latest_step(folder: str) -> int:
    """Largest ``N`` of a complete ``step-N`` checkpoint (``.metadata`` present), or -1."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    steps = [int(m.group(1)) for n in names if (m := re.fullmatch(r"step-(\d+)", n)) and _complete(folder, m[1])]
    return max(steps, default=-1)


def check_resume_compatible(folder: str, step: int, meta: dict) -> None:
    """Refuse to resume from ``step-<step>`` saved with another flavor, mode or layout than ``meta``
    (UserError naming both)."""
    path = os.path.join(folder, f"step-{step}", META_FILE)
    if not os.path.isfile(path):
        logger.warning("checkpoint %s has no %s: cannot check flavor/layout before loading", path, META_FILE)
        return
    with open(path) as f:
        saved = json.load(f)
    for key, what in (("flavor", "model flavor"), ("mode", "compile mode"), ("layout", "parallel layout")):
        if saved.get(key) != meta.get(key):
            hint = (f"Resharding a traced-FSDP checkpoint to another layout is not supported: resume with the "
                    f"saved layout ({saved.get(key)})" if key == "layout"
                    else f"Use --model.flavor/--compile.mode as saved ({saved.get(key)})")
            raise UserError(f"Checkpoint {os.path.dirname(path)} was saved with {what} {saved.get(key)!r} but this "
                            f"run uses {meta.get(key)!r}. {hint}, or point --checkpoint.folder / --job.dump_folder "
                            f"elsewhere.")


def verify_checkpoint_files(ckpt: str):
    """The DCP ``Metadata`` of ``ckpt``, once every data file it refers to exists and is long enough.
    Raises UserError: unreadable ``.metadata``, or a missing / truncated data file (named)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(ckpt).read_metadata()
    except Exception as e:
        raise UserError(f"Checkpoint {ckpt}: {os.path.join(ckpt, '.metadata')} is unreadable "
                        f"({type(e).__name__}: {e}); the checkpoint is corrupt.") from None
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        if (rel := getattr(info, "relative_path", None)) is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        path = os.path.join(ckpt, rel)
        if not os.path.isfile(path):
            raise UserError(f"Checkpoint {ckpt} is incomplete: data file {path} is missing.")
        if (have := os.path.getsize(path)) < size:
            raise UserError(f"Checkpoint {ckpt} is truncated: data file {path} has {have} bytes, its metadata "
                            f"needs {size}.")
    return md


def require_complete(folder: str, step: int) -> None:
    """Check that ``--checkpoint.load_step step`` names a complete checkpoint in ``folder``.
    Raises UserError: ``step-<step>`` is missing or unfinished; names the latest complete one."""
    if not _complete(folder, step):
        ckpt = os.path.join(folder, f"step-{step}")
        what = "is incomplete (no .metadata: its save did not finish)" if os.path.isdir(ckpt) else "does not exist"
        have = latest_step(folder)
        raise UserError(f"--checkpoint.load_step {step}: checkpoint {ckpt} {what}. "
                        + (f"The latest complete one is step-{have}." if have > 0 else "No complete one exists."))


def is_model_only(md) -> bool:
    """True when DCP ``Metadata`` ``md`` lists no ``train_state`` (``--checkpoint.last_save_model_only``)."""
    return not any(k == "train_state" or k.startswith("train_state.") for k in md.state_dict_metadata)


def _full_steps(folder: str, below: int) -> list[int]:
    """Steps ``< below`` of complete, readable checkpoints that can resume training, ascending."""
    from torch.distributed.checkpoint import FileSystemReader

    out = []
    for s in (s for s in range(below) if _complete(folder, s)):
        with contextlib.suppress(Exception):  # an unreadable one is no resume point
            if not is_model_only(FileSystemReader(os.path.join(folder, f"step-{s}")).read_metadata()):
                out.append(s)
    return out


def _first_cause(e: BaseException) -> BaseException:
    """The first real exception in DCP's (nested) ``CheckpointException.failures``, else ``e``."""
    for _ in range(4):
        if not (failures := getattr(e, "failures", None)):
            break
        first = next(iter(failures.values()))  # (exception, traceback summary)
        e = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    return e


class Checkpointer:
    """torchtitan's ``CheckpointManager`` plus the checks above; every method is a no-op when
    ``--checkpoint.enable`` is off (``enabled`` False)."""

    def __init__(self, cfg, dataloader, model_part, optimizers, lr_schedulers, device, rank: int, meta: dict):
        from torchtitan.components.checkpoint import CheckpointManager

        self.enabled = bool(cfg.checkpoint.enable)
        if self.enabled and not dist.is_initialized():  # DCP needs a process group, even of 1
            _init_single_process_group(device)
        self.folder, self.rank, self.meta = checkpoint_folder(cfg), rank, meta
        self.train_state = TrainState(0, meta)
        self.manager = CheckpointManager(
            dataloader=dataloader, model_parts=[model_part], optimizers=optimizers, lr_schedulers=lr_schedulers,
            states={"train_state": self.train_state, f"rng_rank{rank}": RNGState(device)},
            checkpoint_config=cfg.checkpoint, sd_adapter=None, base_folder=cfg.job.dump_folder)

    def load_latest(self, load_step: int = -1) -> int:
        """Load ``step-<load_step>`` (-1: the latest complete one); returns the step loaded (0: none). Raises UserError:
        no such complete checkpoint; an incompatible, model-only, truncated or corrupt one (naming it, DCP's first error
        and an older one to resume from; nothing is removed)."""
        step = latest_step(self.folder) if load_step == -1 else load_step
        if not self.enabled or step <= 0:
            return 0
        ckpt = os.path.join(self.folder, f"step-{step}")
        require_complete(self.folder, step)  # only an explicit load_step can name an incomplete one
        check_resume_compatible(self.folder, step, self.meta)

        def hint() -> str:
            older = _full_steps(self.folder, step)
            where = "point --job.dump_folder / --checkpoint.folder elsewhere to start over."
            return (f"resume from step-{older[-1]} with --checkpoint.load_step {older[-1]}, or {where}" if older
                    else f"no older checkpoint in {self.folder} can resume training: {where}")

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
            raise UserError(f"Checkpoint {ckpt} could not be loaded ({type(cause).__name__}: {first}); it may be "
                            f"truncated or corrupt. It is left in place; {hint()}") from None
        logger.info("Resumed from %s (step %d)", ckpt, self.train_state.step)
        return self.train_state.step

    def save(self, step: int, last_step: bool) -> None:
        """Save at ``step`` if torchtitan's policy says so; an earlier run's complete ``step-<step>`` is
        moved aside first (rank 0; UserError naming it if it cannot be)."""
        if not self.enabled:
            return
        self.train_state.step = step
        ckpt = os.path.join(self.folder, f"step-{step}")
        if self.manager._should_save(step, last_step):
            if self.rank == 0 and _complete(self.folder, step):
                try:
                    kept = keep_previous(ckpt)
                except OSError as e:
                    raise UserError(f"Cannot move the earlier checkpoint {ckpt} aside before saving this step "
                                    f"({e.strerror or e}); it was not written over.") from None
                logger.info("An earlier run's checkpoint %s is kept as %s", ckpt, kept)
            if dist.is_initialized() and dist.get_world_size() > 1:  # no rank writes before it is moved
                dist.barrier(device_ids=[torch.cuda.current_device()] if torch.cuda.is_available() else None)
        self.manager.save(step, last_step=last_step)
        if self.rank == 0 and _complete(self.folder, step):
            with open(os.path.join(ckpt, META_FILE), "w") as f:
                json.dump({**self.meta, "step": step}, f, indent=1, sort_keys=True)

    def close(self) -> None:
        """Stop torchtitan's checkpoint threads (no-op when disabled)."""
        if self.enabled:
            self.manager.close()
