# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Where tools/eval_speculative.py's prompts come from, and the tokenizer that encodes them.

The tokenizer is the checkpoint's own unless --tokenizer names another: a run on a dataset
written by tools/preprocess_data.py trained a NullTokenizer of that dataset's vocabulary, and
the dataset's metadata names the tokenizer that wrote it (bytes, a tokenizer.json, a
SentencePiece model); a run given Megatron-LM's --tokenizer-type / --tokenizer-model builds
that tokenizer again, as megatron-core builds it (a NullTokenizer without metadata reads its
prompts as space-separated ids, as upstream's does).
"""

import os

from megatron_mtp.serving import ServingError


def data_prefixes(run_args) -> list[str]:
    """The dataset prefixes of a run's --data-path (a blend's weights left out)."""
    from megatron_mtp.arguments.vocabulary import is_weight

    return [item for item in (getattr(run_args, "data_path", None) or []) if not is_weight(item)]


def tokenizer(run_args, spec: str | None):
    """--tokenizer SPEC, or the checkpoint's own tokenizer; refused in one line."""
    from megatron_mtp.data.indexed import DatasetError, read_metadata
    from megatron_mtp.data.tokenizers import TokenizerError, UpstreamTokenizer, load_tokenizer

    try:
        if spec is not None:
            return load_tokenizer(spec)
        if getattr(run_args, "tokenizer_type", None) == "NullTokenizer":
            for prefix in data_prefixes(run_args):
                metadata = read_metadata(prefix)
                if metadata is None:
                    continue
                name = metadata["tokenizer"]
                if name == "bytes" or os.path.isfile(name):
                    return load_tokenizer(name, metadata.get("eod_token"))
                raise ServingError(f"the checkpoint's data {prefix} was tokenized by {name}, which is not here: "
                                   "give --tokenizer")
        if getattr(run_args, "tokenizer_type", None) is None:
            raise ServingError("the checkpoint names no tokenizer: give --tokenizer")
        return UpstreamTokenizer(run_args)
    except (TokenizerError, DatasetError) as error:
        raise ServingError(f"--tokenizer: {error}" if spec is not None else
                           f"the checkpoint's tokenizer: {error} (give --tokenizer)") from None


def file_prompts(path: str, encode, count: int) -> list[list[int]]:
    """The first `count` non-empty lines of `path`, encoded."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.rstrip("\n") for line in file if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise ServingError(f"--prompts {path}: {error.strerror if isinstance(error, OSError) else error}") from None
    if not lines:
        raise ServingError(f"--prompts {path}: no prompts")
    try:
        return [list(encode(line)) for line in lines[:count]]
    except (ValueError, TypeError) as error:  # a NullTokenizer's prompt that is not ids
        raise ServingError(f"--prompts {path}: the tokenizer cannot encode a line ({error})") from None


def dataset_prompts(prefix: str, count: int, prompt_length: int, new_tokens: int):
    """(prompt, reference text) pairs from documents long enough, spread evenly over the dataset."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    if not os.path.isfile(prefix + ".idx"):
        raise ServingError(f"--data-path {prefix}: no {prefix}.idx")
    documents = IndexedDataset(prefix)
    needed = prompt_length + new_tokens
    long_enough = [i for i in range(len(documents)) if documents.sequence_lengths[i] >= needed]
    if len(long_enough) < count:
        raise ServingError(f"--data-path {prefix}: {len(long_enough)} documents hold {needed} tokens "
                           f"(--prompt-length + --new-tokens), {count} are asked for")
    chosen = [long_enough[(i * len(long_enough)) // count] for i in range(count)]
    pairs = []
    for i in chosen:
        text = [int(t) for t in documents[i][:needed]]
        pairs.append((text[:prompt_length], text))
    return pairs
