# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""megatron-core indexed datasets (PREFIX.bin + PREFIX.idx) with a metadata file PREFIX.json.

The metadata names the tokenizer, its vocabulary size and end-of-document id and the
dataset's size, so the trainer can set up (or check) its vocabulary and refuse a dataset
made with another tokenizer before it builds a model. Writing is atomic per file set: the
three files appear under their names only when complete.
"""

import json
import os
from pathlib import Path

import numpy

from megatron_mtp.data.tokenizers import TokenizerInfo


class DatasetError(ValueError):
    pass


def metadata_path(prefix) -> Path:
    return Path(f"{prefix}.json")


class IndexedWriter:
    """Documents in, PREFIX.{bin,idx,json} out (written under temporary names, then renamed)."""

    def __init__(self, prefix, tokenizer: TokenizerInfo, append_eod: bool = True, metadata: dict | None = None):
        """`append_eod`: end every document with the tokenizer's end-of-document id (always
        with this tool's --tokenizer; with Megatron-LM's flags only under --append-eod, as
        upstream's tool). `metadata`: more fields for PREFIX.json (the tokenizer flags)."""
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.tokenizer = tokenizer
        self.append_eod = append_eod
        self.extra = dict(metadata or {})
        self.partial = self.prefix.with_name(self.prefix.name + f".partial-{os.getpid()}")
        dtype = numpy.uint16 if tokenizer.vocab_size <= numpy.iinfo(numpy.uint16).max + 1 else numpy.int32
        self.builder = IndexedDatasetBuilder(f"{self.partial}.bin", dtype=dtype)
        self.documents = 0
        self.tokens = 0

    def add(self, token_ids: list[int]) -> None:
        """One document; its end-of-document token is appended (with `append_eod`)."""
        ids = list(token_ids) + ([self.tokenizer.eod_id] if self.append_eod else [])
        self.builder.add_document(ids, [len(ids)])
        self.documents += 1
        self.tokens += len(ids)

    def abort(self) -> None:
        """Remove the partial files (an interrupted or failed run leaves no debris)."""
        for suffix in (".bin", ".idx", ".json"):
            Path(f"{self.partial}{suffix}").unlink(missing_ok=True)

    def finish(self) -> dict:
        self.builder.finalize(f"{self.partial}.idx")
        metadata = {"tokenizer": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size,
                    "eod_id": self.tokenizer.eod_id, "append_eod": self.append_eod, **self.extra,
                    "documents": self.documents, "tokens": self.tokens}
        metadata_path(self.partial).write_text(json.dumps(metadata, indent=2) + "\n")
        for suffix in (".bin", ".idx", ".json"):  # the metadata last: it marks a complete set
            os.replace(f"{self.partial}{suffix}", f"{self.prefix}{suffix}")
        return metadata


def read_metadata(prefix) -> dict | None:
    """The dataset's metadata, or None for a dataset this project did not write."""
    path = metadata_path(prefix)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise DatasetError(f"{path} is corrupt: {error}") from error


def check_dataset(prefix) -> None:
    """A readable .bin/.idx pair whose sizes agree; one clear error otherwise."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bin_path, idx_path = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    missing = [str(p) for p in (bin_path, idx_path) if not p.is_file()]
    if missing:
        raise DatasetError(f"dataset {prefix}: missing {' and '.join(missing)}")
    try:
        dataset = IndexedDataset(str(prefix), mmap=True)
        expected = int(dataset.index.sequence_lengths.sum()) * dataset.index.dtype_size
    except Exception as error:
        raise DatasetError(f"dataset {prefix}: {idx_path} is corrupt ({error})") from error
    if bin_path.stat().st_size != expected:
        raise DatasetError(f"dataset {prefix}: {bin_path} holds {bin_path.stat().st_size} bytes but "
                           f"{idx_path} describes {expected}; the files are corrupt or do not belong together")
