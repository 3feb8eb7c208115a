#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Turn JSON lines into a megatron-core indexed dataset for pretrain_gpt_mtp.py.

Megatron-LM's own command lines work unchanged (its tools/preprocess_data.py's flags, the
tokenizer built by megatron-core as there, the same file names):

    tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model path/to/tokenizer_dir \\
        --json-keys text --append-eod --workers 4
    # -> data/corpus_text_document.{bin,idx,json}; train with --data-path data/corpus_text_document

and so does this tool's shorter form (every document ends with the end-of-document id):

    tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer bytes | path/to/tokenizer.json | path/to/spm.model [--json-key text] [--workers 4]
    # -> data/corpus.{bin,idx,json}; train with --data-path data/corpus

Each line is one document: the JSON object's field (a string, or a list of strings joined).
With --json-keys (several keys: one dataset per key, as upstream) the output is
PREFIX_{key}_document.{bin,idx}. Beside each dataset, DATASET.json records the tokenizer, its
vocabulary size and end-of-document id and the counts; the trainer takes the vocabulary from
it, or checks the --tokenizer-type/--tokenizer-model it is given against it. Files are
written atomically.
"""

import argparse
import json
import multiprocessing
import sys
import time
import warnings
from pathlib import Path

# megatron-core warns at import about optional GPU packages (Apex, Transformer Engine) that
# writing a dataset never uses.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")


from megatron_mtp.data.indexed import DatasetError, IndexedWriter
from megatron_mtp.data.tokenizers import UPSTREAM_FLAGS, TokenizerError, UpstreamTokenizer, load_tokenizer

_worker = {}


def _tokenizer(args):
    """Megatron-LM's --tokenizer-type (megatron-core's build_tokenizer), else this tool's --tokenizer."""
    if args.tokenizer_type:
        return UpstreamTokenizer(args)
    return load_tokenizer(args.tokenizer, args.eod_token)


def _init_worker(args) -> None:
    _worker["tokenizer"] = _tokenizer(args)
    _worker["keys"] = args.keys


def _encode(numbered_line: tuple[int, str]):
    """(line number, one id list per key or None for a blank line, why the line is skipped)."""
    number, line = numbered_line
    if not line.strip():
        return number, None, None
    try:
        document = json.loads(line)
    except json.JSONDecodeError as error:
        return number, None, f"not JSON ({error.msg})"
    ids = []
    for key in _worker["keys"]:
        text = document.get(key) if isinstance(document, dict) else None
        parts = text if isinstance(text, list) else [text]
        if not parts or not all(isinstance(part, str) for part in parts):
            return number, None, f"no string field {key!r}"
        ids.append([i for part in parts for i in _worker["tokenizer"].encode(part)])
    return number, ids, None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as the tool's other errors (no usage block)
        print(f"preprocess_data: error: {message} (--help lists the flags)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    from megatron.training.arguments import _add_tokenizer_args

    parser = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", required=True, type=Path, help="a .jsonl file, one document per line")
    group.add_argument("--json-keys", nargs="+", default=None,
                       help="Megatron-LM's: the fields to write, one dataset PREFIX_{key}_document per key")
    group.add_argument("--json-key", default=None,
                       help="this tool's: the one field to write to PREFIX (default: text)")
    group.add_argument("--split-sentences", action="store_true", help="refused: needs nltk's sentence splitter")
    group.add_argument("--keep-newlines", action="store_true", help="accepted (matters with --split-sentences only)")
    group = parser.add_argument_group("tokenization")
    group.add_argument("--tokenizer", default=None,
                       help="this tool's: 'bytes' (UTF-8 bytes), a Hugging Face tokenizer.json, or a SentencePiece "
                            ".model; or Megatron-LM's --tokenizer-type/--tokenizer-model (below)")
    group.add_argument("--eod-token", help="--tokenizer tokenizer.json only: the end-of-document token "
                                           "(default: </s>, ...)")
    group.add_argument("--append-eod", action="store_true",
                       help="end each document with the tokenizer's end-of-document id (Megatron-LM's flag; "
                            "always done with --tokenizer)")
    group.add_argument("--lang", default="english", help="accepted (matters with --split-sentences only)")
    _add_tokenizer_args(parser)  # Megatron-LM's tokenizer flags, as its tools/preprocess_data.py takes them
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True,
                       help="writes PREFIX_{key}_document.{bin,idx,json} with --json-keys or --tokenizer-type, "
                            "else PREFIX.{bin,idx,json}")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    group.add_argument("--partitions", type=int, default=1,
                       help="accepted: one pass writes what upstream's partitions merge into, in input order")
    group.add_argument("--keep-sequential-samples", action="store_true", help="accepted: the order is the input's")
    group.add_argument("--log-interval", type=int, default=10000, help="progress every N documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.partitions < 1:
        parser.error("--partitions must be >= 1")
    if args.log_interval < 1:
        parser.error("--log-interval must be >= 1")
    if args.split_sentences:
        parser.error("--split-sentences needs nltk's sentence splitter, which this tool does not use: drop it "
                     "(one document per line, level 'document')")
    if (args.tokenizer is None) == (args.tokenizer_type is None):
        parser.error("name one tokenizer: --tokenizer-type TYPE [--tokenizer-model PATH] (Megatron-LM's) or "
                     "--tokenizer bytes|FILE.json|FILE.model (this tool's)"
                     if args.tokenizer is None else "--tokenizer and --tokenizer-type both name a tokenizer: keep one")
    if args.tokenizer_type and args.eod_token:
        parser.error("--eod-token is for --tokenizer FILE.json; with --tokenizer-type the end of document is the "
                     "tokenizer's own eos token, as in Megatron-LM")
    if args.json_keys and args.json_key:
        parser.error("--json-key and --json-keys both name the fields: keep one")
    if args.json_keys and len(set(args.json_keys)) != len(args.json_keys):
        parser.error(f"--json-keys names a key twice: {' '.join(args.json_keys)}")
    # Megatron-LM's naming ({prefix}_{key}_document) with its flags; this tool's (PREFIX) otherwise.
    upstream_naming = args.tokenizer_type is not None or args.json_keys is not None
    args.keys = args.json_keys or [args.json_key or "text"]
    args.prefixes = [f"{args.output_prefix}_{key}_document" for key in args.keys] if upstream_naming \
        else [args.output_prefix]
    args.eod = args.append_eod or args.tokenizer is not None
    return args


def _write_documents(args, writers: list[IndexedWriter]) -> list[str]:
    """Tokenize every line into `writers` (one per key, in `--workers` processes); the lines skipped."""
    start, skipped = time.perf_counter(), []
    pool = None
    with open(args.input, encoding="utf-8") as lines:
        numbered = enumerate(lines, start=1)
        if args.workers == 1:
            _init_worker(args)
            results = map(_encode, numbered)
        else:
            pool = multiprocessing.Pool(args.workers, _init_worker, (args,))
            results = pool.imap(_encode, numbered, chunksize=64)  # in order: the output is deterministic
        try:
            for number, ids, problem in results:
                if problem:
                    skipped.append(f"line {number}: {problem}")
                elif ids is not None:
                    for writer, document in zip(writers, ids):
                        writer.add(document)
                    if writers[0].documents % args.log_interval == 0:
                        rate = writers[0].documents / (time.perf_counter() - start)
                        print(f"{writers[0].documents} documents, {sum(w.tokens for w in writers)} tokens "
                              f"({rate:.0f} docs/s)", file=sys.stderr, flush=True)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    if writers[0].documents == 0:
        raise DatasetError(f"{args.input} holds no document with a string field {' and '.join(map(repr, args.keys))}")
    return skipped


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if not args.input.is_file():
            raise DatasetError(f"input {args.input} does not exist")
        tokenizer = _tokenizer(args)  # fails here, before any work
        flags = {flag: getattr(args, flag) for flag in UPSTREAM_FLAGS if getattr(args, flag) is not None} \
            if args.tokenizer_type else {}
        writers = []
        try:
            for prefix, key in zip(args.prefixes, args.keys):
                writers.append(IndexedWriter(prefix, tokenizer.info, append_eod=args.eod,
                                             metadata=dict(flags, json_key=key)))
            skipped = _write_documents(args, writers)
            metadata = [writer.finish() for writer in writers]
        except BaseException:
            for writer in writers:
                writer.abort()  # no partial files left behind
            raise
    except (TokenizerError, DatasetError, UnicodeDecodeError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    for prefix, written in zip(args.prefixes, metadata):
        print(f"wrote {prefix}.{{bin,idx,json}}: {written['documents']} documents, "
              f"{written['tokens']} tokens (tokenizer {written['tokenizer']}, vocabulary {written['vocab_size']}, "
              f"end of document {written['eod_id']}{'' if args.eod else ', not appended'}) in {seconds:.1f} s")
    if skipped:
        print(f"skipped {len(skipped)} line(s): " + "; ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
