# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The embedded default corpus: the Python Language Reference's topic texts, which every
CPython ships (pydoc_data.topics: about 0.47 MB of English prose and grammar), one document
per topic, tokenized as bytes. No download, the same tokens on every machine."""

import hashlib
import os
from pathlib import Path

from megatron_mtp.data.indexed import IndexedWriter, read_metadata
from megatron_mtp.data.tokenizers import ByteTokenizer

NAME = "python-reference-topics"


def documents() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def corpus_path(cache_dir) -> Path:
    """The corpus's prefix in `cache_dir` (keyed by its content), written or not."""
    digest = hashlib.sha256("\0".join(documents()).encode()).hexdigest()[:12]
    return Path(cache_dir) / f"{NAME}-{digest}_text_document"


def corpus_prefix(cache_dir) -> Path:
    """Write the corpus once into `cache_dir` and return its prefix (corpus_path).

    Every rank may call this at once: each writes under its own temporary names and renames
    the complete files into place, so readers see a whole dataset or none.
    """
    prefix = corpus_path(cache_dir)
    if read_metadata(prefix) is None:
        tokenizer = ByteTokenizer()
        writer = IndexedWriter(prefix, tokenizer.info)
        for text in documents():
            writer.add(tokenizer.encode(text))
        writer.finish()
    return prefix


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_MTP_CACHE", Path.home() / ".cache" / "megatron-mtp"))
