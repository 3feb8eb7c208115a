# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Tokenizers that need no download: bytes, a Hugging Face tokenizer.json, a SentencePiece model.

Each maps text to token ids and names its vocabulary size and end-of-document id, which
the dataset's metadata records and the trainer checks against the model.
"""

from dataclasses import dataclass
from pathlib import Path


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class TokenizerInfo:
    name: str  # "bytes", or the file it was loaded from
    vocab_size: int
    eod_id: int


class ByteTokenizer:
    """UTF-8 bytes (ids 0-255) and an end-of-document id 256."""

    info = TokenizerInfo(name="bytes", vocab_size=257, eod_id=256)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class HuggingFaceTokenizer:
    """A tokenizer.json (the `tokenizers` library); end of document: `eod_token`, else the
    first of </s>, <|endoftext|>, <eos> in its vocabulary."""

    EOD_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")

    def __init__(self, path: Path, eod_token: str | None = None):
        try:
            from tokenizers import Tokenizer
        except ImportError as error:
            raise TokenizerError("a tokenizer.json needs the `tokenizers` package (pip install tokenizers)") from error
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises a bare Exception on a bad file
            raise TokenizerError(f"{path} is not a readable tokenizer.json: {error}") from error
        candidates = [eod_token] if eod_token else self.EOD_CANDIDATES
        eod = next((self.tokenizer.token_to_id(t) for t in candidates if self.tokenizer.token_to_id(t) is not None),
                   None)
        if eod is None:
            raise TokenizerError(f"{path} has no end-of-document token among {', '.join(candidates)}; "
                                 "name one with --eod-token")
        self.info = TokenizerInfo(name=str(path), vocab_size=self.tokenizer.get_vocab_size(), eod_id=eod)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


class SentencePieceTokenizer:
    """A SentencePiece model; end of document: its </s> (eos) id."""

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError as error:
            raise TokenizerError("a SentencePiece model needs the `sentencepiece` package "
                                 "(pip install sentencepiece)") from error
        try:
            self.model = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as error:
            raise TokenizerError(f"{path} is not a readable SentencePiece model: {error}") from error
        if self.model.eos_id() < 0:
            raise TokenizerError(f"{path} has no end-of-sequence token to end documents with")
        self.info = TokenizerInfo(name=str(path), vocab_size=self.model.get_piece_size(), eod_id=self.model.eos_id())

    def encode(self, text: str) -> list[int]:
        return self.model.encode(text)


def load_tokenizer(spec: str, eod_token: str | None = None):
    """"bytes", a tokenizer.json file, or a SentencePiece .model file."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r} is neither 'bytes' nor an existing file")
    if path.suffix == ".json":
        return HuggingFaceTokenizer(path, eod_token)
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise TokenizerError(f"tokenizer file {path} is neither a tokenizer.json (.json) nor a SentencePiece model "
                         "(.model)")


# Megatron-LM's tokenizer flags (megatron.training.arguments._add_tokenizer_args) that name
# what a tokenizer maps text to; what the dataset's metadata records for an upstream tokenizer.
UPSTREAM_FLAGS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size")


class UpstreamTokenizer:
    """Megatron-LM's `--tokenizer-type T --tokenizer-model M` (HuggingFaceTokenizer with a
    local tokenizer directory, SentencePieceTokenizer with a .model file, GPT2BPETokenizer with
    --vocab-file/--merge-file, ...), built by megatron-core's build_tokenizer exactly as
    Megatron-LM's tools/preprocess_data.py and training loop build it: the same ids, the
    same end-of-document id (its `eod`), the same vocabulary size."""

    def __init__(self, args):
        import copy

        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

        args = copy.copy(args)
        args.pad_vocab_size = False  # padding is the trainer's business (by TP), not the data's
        self.spec = describe(args)
        try:
            self.tokenizer = build_tokenizer(args)
            vocab_size, eod = self.tokenizer.vocab_size, self.tokenizer.eod
        except Exception as error:  # ValueError, OSError, the libraries' own errors
            raise TokenizerError(f"{self.spec}: {_first_line(error)}") from error
        if eod is None:
            raise TokenizerError(f"{self.spec} has no end-of-document (eos) token")
        self.info = TokenizerInfo(name=self.spec, vocab_size=int(vocab_size), eod_id=int(eod))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.tokenize(text))


def describe(args) -> str:
    """The tokenizer flags as a user writes them, e.g. "--tokenizer-type HuggingFaceTokenizer
    --tokenizer-model tok/"."""
    parts = []
    for flag in UPSTREAM_FLAGS:
        value = getattr(args, flag, None)
        if value is not None:
            parts.append(f"--{flag.replace('_', '-')} {value}")
    return " ".join(parts)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
