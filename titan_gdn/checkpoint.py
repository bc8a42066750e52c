"""Checkpoints verified before they are used.

DCP writes `.metadata` last, so a step folder without it was interrupted while being written
(`checkpoint_steps`). What `.metadata` cannot show is a file damaged after the save: a
disk, a copy or a sync tool that zeroes or cuts bytes leaves a folder that loads without an error
and trains on other weights. So every save records a CRC-32 of each of its data files in
`checksums.json`, written just before `.metadata` (`ChecksummedWriter`), and a resume checks the
folder against it first (`checkpoint_damage`); a damaged checkpoint is skipped for the newest one
before it that is intact, with a line saying so (`VerifiedCheckpointManager`, torchtitan's
CheckpointManager with both; it also says when a resume continues on another learning-rate
schedule, `schedule_change`, or keeps the checkpoint's rate over a new optimizer.lr,
`base_rate_change`). A folder without `checksums.json` (written by torchtitan itself)
still has its files checked against the sizes its `.metadata` records.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import zlib
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torchtitan.components.checkpoint import LR_SCHEDULER, AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from titan_gdn.checkpoint_folders import checkpoint_steps, gib, resume_hint, step_folder

CHECKSUMS_FILE = "checksums.json"
# The name under which a rank's checksums travel to the coordinator with its write results;
# taken out again before DCP records the results in .metadata.
_CHECKSUMS_RESULT = "titan_gdn.file_checksums"


class CheckpointDamageError(RuntimeError):
    pass


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written for want of disk space."""


def no_room(error: BaseException, folder: Path, needed: int) -> str | None:
    """Why writing `needed` bytes into `folder` failed, if for want of space: ENOSPC or
    EDQUOT in the error's chain, or less free space than that (torch.save's writer then fails
    with `enforce fail at inline_container.cc ... unexpected pos`, no errno)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(cause.errno)
        cause = cause.__cause__ or cause.__context__
    if needed <= 0:
        return None
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # the folder is gone: nothing to tell from
        return None
    return f"{gib(free)} free for this rank's {gib(needed)}" if free < needed else None


def _plan_bytes(plan) -> int:
    """The tensor bytes a rank's DCP write plan writes."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            count = math.prod(item.tensor_data.chunk.sizes)
            total += count * item.tensor_data.properties.dtype.itemsize
    return total


def file_crc32(path: Path) -> int:
    checksum = 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, plus `checksums.json`: each rank checksums the files it wrote (read
    back from the page cache), the coordinator writes them all before `.metadata`."""

    def prepare_global_plan(self, plans):
        # On the coordinator, before any rank writes: a folder being written again is
        # incomplete until its new .metadata, not complete with the old one.
        for name in (".metadata", CHECKSUMS_FILE):
            with suppress(FileNotFoundError):
                os.remove(Path(self.path) / name)
        return super().prepare_global_plan(plans)

    def write_data(self, plan, planner) -> Future[list[WriteResult]]:
        try:
            results = super().write_data(plan, planner).wait()
        except Exception as error:
            reason = no_room(error, Path(self.path), _plan_bytes(plan))
            if reason is None:
                raise
            raise CheckpointWriteError(f"no room on its disk ({reason})") from error
        written = {result.storage_data.relative_path for result in results}
        checksums = {name: file_crc32(Path(self.path) / name) for name in sorted(written)}
        carrier = WriteResult(MetadataIndex(_CHECKSUMS_RESULT), 0, checksums)
        future: Future[list[WriteResult]] = Future()
        future.set_result([*results, carrier])
        return future

    def finish(self, metadata, results: list[list[WriteResult]]) -> None:
        checksums, data_results = {}, []
        for rank_results in results:
            data_results.append([])
            for result in rank_results:
                if result.index.fqn == _CHECKSUMS_RESULT:
                    checksums.update(result.storage_data)
                else:
                    data_results[-1].append(result)
        _write_atomically(Path(self.path) / CHECKSUMS_FILE, json.dumps({"crc32": checksums}))
        super().finish(metadata, data_results)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, path)


def checkpoint_damage(folder: Path, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the DCP step folder `folder`, [] when nothing is: `.metadata` that
    cannot be read, a data file missing or shorter than `.metadata` says, or one whose bytes
    differ from those saved (`checksums.json`). `share` = (i, n) reads only every n-th data file
    from the i-th, so that n ranks read the folder once between them."""
    folder = Path(folder)
    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
        checksums = _saved_checksums(folder)
    except Exception as error:  # unpickling or JSON errors of every kind
        return [f"its metadata cannot be read ({type(error).__name__}: {error})"]
    sizes: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    index, count = share
    return [
        problem
        for name in sorted(sizes)[index::count]
        if (problem := _file_damage(folder / name, sizes[name], checksums))
    ]


def _saved_checksums(folder: Path) -> dict[str, int] | None:
    path = folder / CHECKSUMS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())["crc32"]


def _file_damage(path: Path, size: int, checksums: dict[str, int] | None) -> str | None:
    if not path.is_file():
        return f"{path.name} is missing"
    found = path.stat().st_size
    if found < size:
        return f"{path.name} is cut short ({found:,} of {size:,} bytes)"
    if checksums is None:
        return None
    if path.name not in checksums:
        return f"{path.name} has no checksum in {CHECKSUMS_FILE}"
    if file_crc32(path) != checksums[path.name]:
        return f"{path.name} holds other bytes than were saved (its checksum differs)"
    return None


def newest_intact_step(folder: Path, damage: Callable[[Path], list[str]]) -> int:
    """The newest complete step in `folder` that `damage` finds nothing wrong with, logging each
    newer one it skips; -1 when there is no complete step. Every complete step damaged is an
    error: resuming from none would start over in a folder that holds a run."""
    complete, _ = checkpoint_steps(folder)
    for step in reversed(complete):
        problems = damage(Path(folder) / f"step-{step}")
        if not problems:
            return step
        logger.warning(
            f"Ignoring checkpoint step-{step} in {folder}: damaged since it was saved "
            f"({'; '.join(problems)}); trying the one before it"
        )
    if complete:
        raise CheckpointDamageError(
            f"every checkpoint in {folder} is damaged (see above): there is none to resume "
            "from; restore the folder from a copy, or move it away to start the run afresh"
        )
    return -1


def schedule_change(schedulers) -> str | None:
    """What changed when a resumed learning-rate schedule (torchtitan's LRSchedulersContainer,
    its state just loaded) is not the one the checkpoint was trained with, else None.

    The checkpoint keeps the schedule's position and its last learning rate, not its shape:
    training.steps sets the length (unless lr_scheduler.total_steps does), so a rerun with more
    steps continues on another curve. The saved rate for the next step against the one this
    run's schedule gives there tells them apart."""
    scheduler = schedulers.schedulers[0]
    step = scheduler.last_epoch
    if step == 0:
        return None  # nothing restored: a fresh or a model-only start
    saved = scheduler.get_last_lr()[0]
    now = scheduler.base_lrs[0] * scheduler.lr_lambdas[0](step)
    if math.isclose(saved, now, rel_tol=1e-6):
        return None
    return (
        f"The learning-rate schedule is not the one the checkpoint of step {step} was trained "
        f"with (training.steps or [lr_scheduler] changed): step {step + 1} trains at lr "
        f"{now:.4g} where it had {saved:.4g}, and the run follows this run's schedule from "
        "here, so it is not what an uninterrupted run of this length would be. To lengthen a "
        "run exactly, set lr_scheduler.total_steps to its final length from its first start"
    )


def base_rates(schedulers) -> list[float]:
    """The schedule's base learning rates, one per parameter group: optimizer.lr until a
    checkpoint's scheduler state replaces them."""
    return list(schedulers.schedulers[0].base_lrs)


def base_rate_change(schedulers, configured: list[float]) -> str | None:
    """What a resume keeps when optimizer.lr changed since the checkpoint, else None.

    The checkpoint's scheduler state holds its base rate, and torchtitan restores it over the
    configured one (LambdaLR.load_state_dict): a resume with a new optimizer.lr trains at the
    old rate. That is kept, since the optimizer's state was shaped by it; the log says so."""
    scheduler = schedulers.schedulers[0]
    step = scheduler.last_epoch
    restored = list(scheduler.base_lrs)
    if step == 0 or len(restored) != len(configured):
        return None  # nothing restored: a fresh or a model-only start
    changed = [
        (saved, wanted)
        for saved, wanted in zip(restored, configured, strict=True)
        if not math.isclose(saved, wanted, rel_tol=1e-6)
    ]
    if not changed:
        return None
    saved, wanted = changed[0]
    return (
        f"optimizer.lr = {wanted:.4g} differs from the learning rate the checkpoint of step "
        f"{step} was trained with, {saved:.4g}: the resumed run keeps the checkpoint's "
        f"{saved:.4g} (its schedule state holds the base rate, as torchtitan restores it), and "
        f"optimizer.lr is not used. Set optimizer.lr = {saved:.4g} to match, or, to train at "
        f"{wanted:.4g}, start a new run (a new job.dump_folder) from these weights with "
        "checkpoint.initial_load_path"
    )


class VerifiedCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager that saves with checksums and resumes from the newest
    intact checkpoint, saying so when the learning-rate schedule or its base rate changed."""

    _saving = ""  # the checkpoint last handed to DCP

    def dcp_save(
        self,
        state_dict,
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        with self._full_disk_named(checkpoint_id):
            result = self._dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        self._saving = checkpoint_id
        return result

    def _async_wait(self) -> None:
        # An async save that failed raises here, at the next save: name the one that failed.
        with self._full_disk_named(self._saving):
            super()._async_wait()

    @contextmanager
    def _full_disk_named(self, checkpoint_id: str):
        """DCP's CheckpointException of a save that found its disk full, as one message."""
        try:
            yield
        except CheckpointException as error:
            # Every rank gets every rank's failures: each says why the save failed.
            failures = [failure for failure, _ in error.failures.values()]
            reasons = [str(f) for f in failures if isinstance(f, CheckpointWriteError)]
            reasons += [no_room(f, Path(checkpoint_id), 0) for f in failures]
            reason = next((reason for reason in reasons if reason), None)
            if reason is None:
                raise
            raise CheckpointWriteError(self._no_room_message(checkpoint_id, reason)) from None

    def _no_room_message(self, checkpoint_id: str, reason: str) -> str:
        complete, _ = checkpoint_steps(self.folder)
        last = step_folder(self.folder, complete[-1]) if complete else None
        k = self.keep_latest_k
        keep = f"= {k} keeps the newest {k}" if k > 0 else "= 0 keeps them all, N the newest N"
        return (
            f"Saving the checkpoint {checkpoint_id} failed: {reason}. Free space (checkpoint."
            f"keep_latest_k {keep}), or point job.dump_folder at a larger disk; then "
            f"{resume_hint(True, last)} (the incomplete {Path(checkpoint_id).name} is skipped; "
            "delete it to get its space back)"
        )

    def _dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf):
        if to_hf:  # an HF export: safetensors for other tools, not a resume point
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        # torchtitan's dcp_save with the writer given (it lets DCP pick the plain one).
        writer = ChecksummedWriter(checkpoint_id)
        if async_mode == AsyncMode.ASYNC:
            result = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            result = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            result = dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return result

    def _find_load_step(self, folder: str = "") -> int:
        if folder:  # fault tolerance's own folders
            return super()._find_load_step(folder)
        return newest_intact_step(Path(self.folder), self._damage)

    def load(self, step: int = -1) -> bool:
        if self.enable:
            self._refuse_damaged(step)
        configured = base_rates(self.states[LR_SCHEDULER])
        loaded = super().load(step)
        if loaded:
            schedulers = self.states[LR_SCHEDULER]
            for change in (
                schedule_change(schedulers),
                base_rate_change(schedulers, configured),
            ):
                if change:
                    logger.warning(change)
        return loaded

    def _refuse_damaged(self, step: int) -> None:
        """The checkpoint torchtitan is asked for by name, checked before it is read."""
        if os.path.exists(self.folder):
            if step == -1:
                return  # _find_load_step picks the newest intact one
            path, setting = Path(self._create_checkpoint_id(step)), f"checkpoint.load_step = {step}"
            fix = "choose another step, or -1 for the newest intact one"
        elif self.initial_load_path and not self.initial_load_in_hf:
            path, setting = Path(self.initial_load_path), "checkpoint.initial_load_path"
            fix = "point it at an intact checkpoint"
        else:
            return
        problems = self._damage(path)
        if problems:
            raise CheckpointDamageError(
                f"{setting}: {path} is damaged since it was saved ({'; '.join(problems)}); {fix}"
            )

    def _damage(self, folder: Path) -> list[str]:
        """checkpoint_damage, each rank reading its share of the files, gathered, so that all
        ranks reach the same verdict."""
        if not (folder / ".metadata").is_file():
            return []  # an HF export; validation refuses resuming from one
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return checkpoint_damage(folder)
        world = dist.get_world_size()
        own = checkpoint_damage(folder, share=(dist.get_rank(), world))
        everyone: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(everyone, own)
        return sorted({problem for problems in everyone for problem in problems})
