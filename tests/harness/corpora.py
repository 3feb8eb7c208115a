# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Small text corpora for trainer tests, written as jsonl and preprocessed like a user's.

Paragraphs of the Python Language Reference (shipped with CPython) make documents of
very uneven length: with --eod-mask-loss every end-of-document target is masked, so the
loss masks have holes at irregular places and the micro-batches of a step hold different
numbers of valid tokens, which is what exact normalization must get right.

For the library's steps (no dataset): `global_batch`, byte-level tokens of a short text every
Python ships (`embedded_corpus`), drawn deterministically per step.
"""

import ast
import codecs
import importlib.util
import json
from pathlib import Path

import torch

from megatron_mtp.data.embedded import documents


def paragraphs(limit: int | None = None) -> list[str]:
    found = [p.strip() for text in documents() for p in text.split("\n\n") if 5 <= len(p.strip()) <= 400]
    return found[:limit]


def sentences(limit: int | None = None) -> list[str]:
    """Shorter documents still (3 to 80 characters): a 64-token sample holds several."""
    found = [s.strip() for p in paragraphs() for s in p.replace("\n", " ").split(". ") if 3 <= len(s.strip()) <= 80]
    return found[:limit]


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: text, "id": i}) + "\n" for i, text in enumerate(texts)))
    return path


def preprocess(jsonl: Path, prefix: Path, tokenizer: str = "bytes", *extra: str) -> Path:
    """tools/preprocess_data.py in this process; returns the dataset prefix."""
    from tools.preprocess_data import main

    code = main(["--input", str(jsonl), "--output-prefix", str(prefix), "--tokenizer", tokenizer, *extra])
    assert code == 0, f"preprocess_data exited with {code}"
    return prefix


def corpus_prompts(count: int, length: int, new_tokens: int) -> list:
    """`count` prompts of `length` tokens from the embedded corpus (megatron_mtp.serving.prompts, as
    tools/eval_speculative.py takes them), each followed there by `new_tokens` more."""
    from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir
    from megatron_mtp.serving import prompts

    pairs = prompts.dataset_prompts(str(corpus_prefix(default_cache_dir())), count, length, new_tokens)
    return [[int(t) for t in prompt] for prompt, _ in pairs]


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
