# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Checkpoint directories committed atomically and checked before a load reads them.

A checkpoint becomes the one to resume from when the tracker file names its iteration;
``write_tracker`` replaces that file atomically, so a save killed at any moment leaves the
tracker naming the previous, complete checkpoint. ``verify`` reads what a load reads first
(tracker, metadata, common state, the tensor files' extents) and names the file that is
missing, truncated or unreadable, before anything is built. Independent of MTP: patch
"Checkpoints: an atomic tracker file" calls it from megatron.training.checkpointing.
"""

import json
import os
import pickle
import tempfile

TRACKER = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message names why."""


def umask_mode(full: int) -> int:
    """`full` (0o666 for a file, 0o777 for a directory) less the process's umask: the mode open()
    and mkdir() give, which files made private by mkstemp or mkdtemp must be given back."""
    umask = os.umask(0)
    os.umask(umask)
    return full & ~umask


def write_tracker(path: str, text: str) -> None:
    """Write the tracker file so that it holds either its old or its new text, never a part."""
    # Here, not at the top: CheckpointError is imported on 0.16.1 too, whose msc_utils lacks maybe_msc.
    from megatron.core.msc_utils import MultiStorageClientFeature, maybe_msc

    if MultiStorageClientFeature.is_enabled():  # object stores replace an object whole
        with maybe_msc.open(path, "w") as file:
            file.write(text)
        return
    directory = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        os.fchmod(descriptor, umask_mode(0o666))  # mkstemp's 0600 would keep other users from resuming
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    directory_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_descriptor)  # the rename itself survives a crash
    finally:
        os.close(directory_descriptor)


def tracked_iteration(load_dir: str) -> int | None:
    """The iteration the tracker names (None: no tracker, a fresh start; 0: a release)."""
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker) as file:
        text = file.read().strip()
    if text == "release":
        return 0
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: the checkpoint tracker holds {text!r}, not an iteration number")
    return int(text)


def checkpoint_directory(load_dir: str, iteration: int) -> str:
    name = "release" if iteration == 0 else f"iter_{iteration:07d}"
    return os.path.join(load_dir, name)


def verify(load_dir: str, step: int | None = None) -> str | None:
    """Check the checkpoint a run would resume from (the tracked one, or `step`); return its
    directory (None: nothing to resume), or raise CheckpointError naming the bad file."""
    iteration = step if step is not None else tracked_iteration(load_dir)
    if iteration is None:
        return None
    directory = checkpoint_directory(load_dir, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory (named by "
                              f"{'--ckpt-step' if step is not None else os.path.join(load_dir, TRACKER)})")
    metadata = os.path.join(directory, "metadata.json")
    if os.path.isfile(metadata):
        try:
            read(metadata, lambda path: json.load(open(path)))
            _verify_torch_dist(directory)
        except CheckpointError as error:
            earlier = [i for i in _iterations(load_dir) if i < iteration]
            if step is not None or not earlier:
                raise
            # resuming from an earlier one into the same directory would overwrite the later ones
            raise CheckpointError(f"{error}; to go on from an earlier checkpoint, give --load {load_dir} "
                                  f"--ckpt-step {earlier[-1]} --save NEW_DIRECTORY") from None
    return directory


def _iterations(load_dir: str) -> list[int]:
    """The iterations of the iter_NNNNNNN directories in `load_dir`, ascending."""
    names = (name[len("iter_"):] for name in os.listdir(load_dir) if name.startswith("iter_"))
    return sorted(int(number) for number in names if number.isdigit())


def read(path: str, reader):
    """reader(path), a failure raised as a CheckpointError naming the file."""
    try:
        return reader(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing from the checkpoint") from None
    except Exception as error:  # any parse failure means the file is damaged
        reason = " ".join(str(error).split()) or type(error).__name__
        raise CheckpointError(f"{path}: unreadable ({reason[:200]})") from None


def _verify_torch_dist(directory: str) -> None:
    """Every tensor file is as long as the index says, and the common state loads."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    index = os.path.join(directory, ".metadata")
    storage = read(index, lambda path: pickle.load(open(path, "rb"))).storage_data or {}
    needed = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, length in sorted(needed.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size = os.path.getsize(path)
        if size < length:
            raise CheckpointError(f"{path}: truncated ({size} bytes, the checkpoint's index needs {length})")
    read(directory, load_common_state_dict)
