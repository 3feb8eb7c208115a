# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The vocabulary a dataset written by tools/preprocess_data.py names: the run takes it
(NullTokenizer of that size and end-of-document id), or builds the --tokenizer-type /
--tokenizer-model it is given when that tokenizer matches it, and refuses a contradicting one.
"""

from megatron_mtp.arguments.defaults import given
from megatron_mtp.arguments.errors import ArgumentError
from megatron_mtp.data.indexed import check_dataset, read_metadata
from megatron_mtp.data.tokenizers import ByteTokenizer


def from_data(args, defaults: dict, embedded: bool) -> None:
    """Tokenizer defaults from the datasets' metadata (the embedded corpus's: bytes, written or
    not yet); a contradiction is an error."""
    prefixes = [p for p in (args.data_path or []) if not is_weight(p)]
    found = {}
    if embedded:
        info = ByteTokenizer.info
        found, prefixes = {prefixes[0]: (info.vocab_size, info.eod_id, info.name)}, prefixes[1:]
    for prefix in prefixes:
        check_dataset(prefix)
        metadata = read_metadata(prefix)
        if metadata is not None:
            found[prefix] = (metadata["vocab_size"], metadata["eod_id"], metadata["tokenizer"])
    if not found:
        return
    if len(set(v[:2] for v in found.values())) > 1:
        raise ArgumentError("the datasets were written with different tokenizers: " + "; ".join(
            f"{p}: {t} (vocabulary {v}, end of document {e})" for p, (v, e, t) in found.items()))
    vocab_size, eod_id, tokenizer = next(iter(found.values()))
    if given("--vocab-size") and args.vocab_size != vocab_size:
        raise ArgumentError(f"--vocab-size {args.vocab_size} does not match the dataset's tokenizer {tokenizer} "
                            f"(vocabulary {vocab_size}); drop --vocab-size or preprocess with the intended tokenizer")
    if given("--tokenizer-type") and args.tokenizer_type != "NullTokenizer":
        # Megatron-LM's way: the tokenizer the data was written with, built as upstream builds it.
        from megatron_mtp.data.tokenizers import TokenizerError, UpstreamTokenizer

        try:
            named = UpstreamTokenizer(args).info
        except TokenizerError as error:
            raise ArgumentError(str(error)) from None
        if (named.vocab_size, named.eod_id) != (vocab_size, eod_id):
            raise ArgumentError(f"the dataset is tokenized by {tokenizer} (vocabulary {vocab_size}, end of document "
                                f"{eod_id}) but {named.name} has vocabulary {named.vocab_size}, end of document "
                                f"{named.eod_id}: its ids would not match (give the tokenizer the data was written "
                                "with, or drop --tokenizer-type to take the dataset's vocabulary)")
        return  # the run builds the tokenizer it was given, as Megatron-LM does
    defaults.update(tokenizer_type="NullTokenizer", vocab_size=vocab_size, null_tokenizer_eod_id=eod_id)


def is_weight(item: str) -> bool:
    """A blend's weight in --data-path (the items are weight, prefix, weight, prefix, ...)."""
    try:
        float(item)
        return True
    except ValueError:
        return False
