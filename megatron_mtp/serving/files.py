# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Reading and writing checkpoints: Hugging Face directories (safetensors, one file or sharded
with its index) and megatron-core torch_dist checkpoints (the trainer's).

Outputs are written into a temporary sibling directory and renamed into place when complete;
an output directory that already holds files is refused before anything is written.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from megatron_mtp.serving import ServingError

TRACKER = "latest_checkpointed_iteration.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json", "chat_template.jinja")
FLAGS_FILE = "megatron_flags.txt"


# ---------------------------------------------------------------- output directories

def check_output(path: str) -> Path:
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ServingError(f"output directory {out} already holds files: give a new or empty directory")
    return out


class Staging:
    """A temporary sibling of `out`, renamed to `out` on success and removed on failure."""

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self) -> Path:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=self.out.parent))
        return self.path

    def _permissions(self):  # mkdtemp (and safetensors) create private files; a checkpoint is shared as usual
        from megatron.core.fork.upstream_fixes.checkpoint_files import umask_mode

        for root, dirs, names in os.walk(self.path):
            for name in dirs:
                os.chmod(os.path.join(root, name), umask_mode(0o777))
            for name in names:
                os.chmod(os.path.join(root, name), umask_mode(0o666))
        os.chmod(self.path, umask_mode(0o777))

    def __exit__(self, kind, error, traceback):
        if kind is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return False
        self._permissions()
        if self.out.exists():
            self.out.rmdir()  # empty (checked before)
        os.rename(self.path, self.out)
        return False


# ---------------------------------------------------------------- Hugging Face

def read_hf(path: str) -> tuple[dict, dict]:
    """config.json and every tensor of a Hugging Face checkpoint directory."""
    from safetensors.torch import load_file

    directory = Path(path)
    if not directory.is_dir():
        raise ServingError(f"{directory}: no such directory")
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ServingError(f"{config_file}: missing (a Hugging Face checkpoint directory has config.json)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ServingError(f"{config_file}: unreadable ({error})") from None
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    elif (directory / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise ServingError(f"{directory}: no model.safetensors or model.safetensors.index.json "
                           "(import reads safetensors)")
    tensors = {}
    for name in files:
        file = directory / name
        if not file.is_file():
            raise ServingError(f"{file}: missing (named by model.safetensors.index.json)")
        try:
            tensors.update(load_file(str(file)))
        except Exception as error:  # a damaged file
            raise ServingError(f"{file}: unreadable ({' '.join(str(error).split())[:200]})") from None
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise ServingError(f"missing tensor {missing[0]} (the index names it in {weight_map[missing[0]]})")
    return config, tensors


def unshared(named_tensors):
    """(name, tensor), each tensor with storage of its own: safetensors refuses tensors that share
    storage (a repeated MTP layer is written once per depth from the same tensors, and a tensor's
    views share its storage), so a tensor whose storage an earlier one holds is copied."""
    seen = set()
    for name, tensor in named_tensors:
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        yield name, tensor


def write_hf(staging: Path, config: dict, tensors: dict, dtype: str, tokenizer: str | None,
             max_shard_bytes: int = 5 * 2**30) -> list[str]:
    """config.json, model.safetensors (sharded with an index above `max_shard_bytes`), the tokenizer's files."""
    from safetensors.torch import save_file

    from megatron_mtp.serving.export import cast

    tensors = dict(cast(tensors, dtype))
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards, current, size = [], {}, 0
    for name in tensors:
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(staging / "model.safetensors"), metadata=metadata)
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(staging / file), metadata=metadata)
            weight_map.update({name: file for name in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        (staging / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    copied = []
    if tokenizer:
        source = Path(tokenizer)
        candidates = [source] if source.is_file() else [source / n for n in TOKENIZER_FILES]
        for file in candidates:
            if file.is_file():
                shutil.copy2(file, staging / file.name)
                copied.append(file.name)
    return copied


# ---------------------------------------------------------------- megatron-core torch_dist

def checkpoint_directory(path: str) -> Path:
    """The iteration directory of a trainer checkpoint: DIR (its tracker names it) or DIR/iter_NNNNNNN."""
    directory = Path(path)
    if not directory.is_dir():
        raise ServingError(f"{directory}: no such directory")
    if (directory / ".metadata").is_file():
        return directory
    tracker = directory / TRACKER
    if not tracker.is_file():
        raise ServingError(f"{directory}: not a megatron-core checkpoint (no {TRACKER}, no .metadata)")
    text = tracker.read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not (directory / name / ".metadata").is_file():
        raise ServingError(f"{tracker}: names {text!r}, which is not a checkpoint in {directory}")
    return directory / name


def read_megatron(path: str) -> tuple[object, dict, Path]:
    """(the run's arguments, every model tensor as a global tensor by checkpoint key, the directory).

    The tensors are read with torch.distributed.checkpoint in this process: the checkpoint holds
    global tensors whatever its TP / PP / VPP layout, so nothing depends on how it was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    args, directory = read_arguments(path)
    reader = dcp.FileSystemReader(str(directory))
    metadata = reader.read_metadata()
    state = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or "_extra_state" in key:
            continue
        if key.startswith(("optimizer", "rng_state", "rerun_state_machine")):
            continue
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return args, state, directory


def read_arguments(path: str) -> tuple[object, Path]:
    """(the run's arguments, the iteration directory) of a trainer checkpoint, no tensor read."""
    from megatron.core.dist_checkpointing import load_common_state_dict

    directory = checkpoint_directory(path)
    return load_common_state_dict(str(directory)).get("args"), directory


def write_megatron(staging: Path, args, tensors: dict, depths_in_tensors: int, seed: int = 1234) -> list[str]:
    """An imported model as a torch_dist release checkpoint: megatron-core's GPTModel is built
    (TP = PP = 1) with `args` (its MTP depths beyond those in `tensors` keep their fresh
    initialization), given the tensors (by the model's state-dict names: mapping.hf_to_megatron),
    and saved through dist checkpointing, so the trainer loads it at any layout. Returns the names
    of the tensors that were initialized rather than imported."""
    from megatron.core import dist_checkpointing

    from megatron.core.fork.training_loop import checkpoint as trainer_checkpoint
    from megatron.core.fork.training_loop.model_shape import model_shape
    from megatron_mtp.serving import model as serving_model

    serving_model.setup(seed)
    gpt = serving_model.build(args)
    own = {k: v for k, v in gpt.state_dict().items() if "_extra_state" not in k}
    unknown = sorted(set(tensors) - set(own))
    if unknown:
        raise ServingError(f"internal: no model parameter for {unknown[0]}")
    for name, value in tensors.items():
        if tuple(own[name].shape) != tuple(value.shape):
            raise ServingError(f"tensor for {name} has shape {list(value.shape)}, the model {list(own[name].shape)}")
    initialized = sorted(set(own) - set(tensors))
    with torch.no_grad():
        for name, value in tensors.items():
            own[name].copy_(value)
    release = staging / "release"
    release.mkdir()
    state = {"model": gpt.sharded_state_dict(metadata=serving_model.sharded_metadata()), "args": args,
             "checkpoint_version": 3.0, "iteration": 0,
             trainer_checkpoint.KEY: {"model_shape": model_shape(gpt), "metrics": None}}
    dist_checkpointing.save(state, str(release),
                            content_metadata={"singleton_tensors_shards": False, "chained_optim_avoid_prefix": True})
    (staging / TRACKER).write_text("release")
    return initialized
