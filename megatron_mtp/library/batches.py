# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Global batches for library use: byte-level tokens of a short text every Python ships.

Each step draws a deterministic global batch (seeded by the step number), and every
data-parallel rank takes its own contiguous slice of it, cut into micro-batches. (The
trainer's embedded default data set is megatron_mtp.data.embedded: a larger text, written
as an indexed data set for upstream's GPTDataset.)
"""

import ast
import codecs
import importlib.util
from pathlib import Path

import torch
from megatron.core import parallel_state

BYTE_VOCAB_SIZE = 256


def embedded_corpus() -> torch.Tensor:
    """The Zen of Python, read from the standard library's `this` module without importing
    it (importing prints it). It is stored rot13-encoded in the module's `s` string."""
    source = Path(importlib.util.find_spec("this").origin).read_text()
    encoded = next(
        node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s"
    )
    text = codecs.decode(encoded, "rot13")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def global_batch(corpus: torch.Tensor, global_batch_size: int, seq_length: int, seed: int, step: int):
    """Tokens [B, S+1] from random windows of the corpus, and an all-ones loss mask [B, S]."""
    if corpus.numel() < seq_length + 2:
        raise ValueError(f"corpus of {corpus.numel()} tokens is shorter than seq_length + 2")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq_length - 1, (global_batch_size,), generator=generator)
    tokens = torch.stack([corpus[s:s + seq_length + 1] for s in starts.tolist()])
    return tokens, torch.ones(global_batch_size, seq_length)


def rank_microbatches(tokens: torch.Tensor, loss_mask: torch.Tensor, micro_batch_size: int) -> list:
    """This data-parallel rank's contiguous share of the global batch, in micro-batches."""
    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    per_rank = tokens.size(0) // dp_size
    if per_rank * dp_size != tokens.size(0) or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch {tokens.size(0)} must split into {dp_size} data-parallel ranks "
            f"of whole micro-batches of {micro_batch_size}"
        )
    tokens = tokens[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    loss_mask = loss_mask[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    return [
        (tokens[i:i + micro_batch_size], loss_mask[i:i + micro_batch_size])
        for i in range(0, per_rank, micro_batch_size)
    ]
