#!/usr/bin/env python3
"""Turn JSON lines into a megatron-core indexed dataset for pretrain_gpt_mtp.py.

    tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer bytes | path/to/tokenizer.json | path/to/spm.model [--json-key text] [--workers 4]

Each line is one document: the JSON object's `--json-key` field. The output is
PREFIX.bin, PREFIX.idx (megatron-core's IndexedDataset; an end-of-document token ends
every document) and PREFIX.json (tokenizer, vocabulary size, end-of-document id, counts),
written atomically. Train on it with `pretrain_gpt_mtp.py --data-path PREFIX`; the trainer
takes the vocabulary from PREFIX.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_mtp.data.indexed import DatasetError, IndexedWriter  # noqa: E402
from megatron_mtp.data.tokenizers import TokenizerError, load_tokenizer  # noqa: E402

_worker = {}


def _init_worker(tokenizer_spec: str, eod_token: str | None, json_key: str) -> None:
    _worker["tokenizer"] = load_tokenizer(tokenizer_spec, eod_token)
    _worker["key"] = json_key


def _encode(numbered_line: tuple[int, str]):
    number, line = numbered_line
    if not line.strip():
        return number, None, None
    try:
        document = json.loads(line)
    except json.JSONDecodeError as error:
        return number, None, f"not JSON ({error.msg})"
    if not isinstance(document, dict) or not isinstance(document.get(_worker["key"]), str):
        return number, None, f"no string field {_worker['key']!r}"
    return number, _worker["tokenizer"].encode(document[_worker["key"]]), None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="a .jsonl file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    parser.add_argument("--tokenizer", required=True,
                        help="'bytes' (UTF-8 bytes), a Hugging Face tokenizer.json, or a SentencePiece .model")
    parser.add_argument("--json-key", default="text", help="the field holding each document's text (default: text)")
    parser.add_argument("--eod-token", help="tokenizer.json only: the end-of-document token (default: </s>, ...)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default: 1)")
    parser.add_argument("--log-interval", type=int, default=10000, help="progress every N documents")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be >= 1")
    return args


def _write_documents(args, writer: IndexedWriter) -> list[str]:
    """Tokenize every line into `writer` (in `--workers` processes); the lines skipped."""
    start, skipped = time.perf_counter(), []
    pool = None
    with open(args.input, encoding="utf-8") as lines:
        numbered = enumerate(lines, start=1)
        if args.workers == 1:
            _init_worker(args.tokenizer, args.eod_token, args.json_key)
            results = map(_encode, numbered)
        else:
            pool = multiprocessing.Pool(args.workers, _init_worker, (args.tokenizer, args.eod_token, args.json_key))
            results = pool.imap(_encode, numbered, chunksize=64)  # in order: the output is deterministic
        try:
            for number, ids, problem in results:
                if problem:
                    skipped.append(f"line {number}: {problem}")
                elif ids is not None:
                    writer.add(ids)
                    if writer.documents % args.log_interval == 0:
                        rate = writer.documents / (time.perf_counter() - start)
                        print(f"{writer.documents} documents, {writer.tokens} tokens ({rate:.0f} docs/s)",
                              file=sys.stderr, flush=True)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    if writer.documents == 0:
        raise DatasetError(f"{args.input} holds no document with a string field {args.json_key!r}")
    return skipped


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if not args.input.is_file():
            raise DatasetError(f"input {args.input} does not exist")
        tokenizer = load_tokenizer(args.tokenizer, args.eod_token)  # fails here, before any work
        writer = IndexedWriter(args.output_prefix, tokenizer.info)
        try:
            skipped = _write_documents(args, writer)
            metadata = writer.finish()
        except BaseException:
            writer.abort()  # no partial files left behind
            raise
    except (TokenizerError, DatasetError, UnicodeDecodeError) as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {args.output_prefix}.{{bin,idx,json}}: {metadata['documents']} documents, "
          f"{metadata['tokens']} tokens (tokenizer {metadata['tokenizer']}, vocabulary {metadata['vocab_size']}, "
          f"end of document {metadata['eod_id']}) in {seconds:.1f} s")
    if skipped:
        print(f"skipped {len(skipped)} line(s): " + "; ".join(skipped[:5]) + (" ..." if len(skipped) > 5 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
