# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Megatron-LM's data and tokenizer conventions, so a user's command lines and datasets work
unchanged (issue 16).

- tools/preprocess_data.py takes Megatron-LM's flags (--tokenizer-type HuggingFaceTokenizer
  with a tokenizer directory, SentencePieceTokenizer with a .model, --json-keys with one
  dataset per key, --append-eod, --workers, --partitions, --log-interval) and writes
  PREFIX_{key}_document.{bin,idx} with the ids megatron-core's own tokenizer gives, and
  its metadata PREFIX_{key}_document.json beside.
- The trainer trains on it with --tokenizer-type/--tokenizer-model as Megatron-LM does; a
  tokenizer that contradicts the dataset's metadata is refused in one line.
- The dataloader builds no attention mask unless asked (the model does not read it).
- --overlap-moe-expert-parallel-comm (upstream's schedule plan) is refused in one line:
  with MTP depths everywhere (it bypasses the exact MTP step), on CPU always (CUDA only).

Tokenizers are trained here from the test corpus (no download): a byte-level BPE saved as a
Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json), a SentencePiece model.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness.corpora import paragraphs
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import TINY, train


def python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


def documents_of(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


def upstream_tokenizer(kind: str, model: Path):
    """The tokenizer as Megatron-LM builds it (megatron-core's build_tokenizer)."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import _add_tokenizer_args

    args = _add_tokenizer_args(argparse.ArgumentParser()).parse_args(
        ["--tokenizer-type", kind, "--tokenizer-model", str(model)])
    args.pad_vocab_size = False
    return build_tokenizer(args)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """A jsonl corpus (fields text and title), a Hugging Face tokenizer directory, a
    SentencePiece model, and the datasets upstream-style command lines write from them."""
    import sentencepiece
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tools.preprocess_data import main

    root = tmp_path_factory.mktemp("megatron_lm_data")
    texts = paragraphs(300)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t, "title": t.split("\n")[0][:30]}) + "\n" for t in texts))
    hf = root / "hf_tokenizer"
    hf.mkdir()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                                             show_progress=False))
    tokenizer.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    (root / "lines.txt").write_text("".join(t.replace("\n", " ") + "\n" for t in texts))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "lines.txt"), model_prefix=str(root / "spm"),
                                             vocab_size=300, model_type="bpe", minloglevel=2)
    # Megatron-LM's own command lines
    assert main(["--input", str(corpus), "--output-prefix", str(root / "hf"),
                 "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf),
                 "--json-keys", "text", "title", "--append-eod", "--workers", "2", "--partitions", "1",
                 "--log-interval", "100"]) == 0
    assert main(["--input", str(corpus), "--output-prefix", str(root / "spm"),
                 "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(root / "spm.model"),
                 "--workers", "1"]) == 0
    return dict(root=root, texts=texts, hf=hf, spm=root / "spm.model")


def test_upstream_command_lines_write_prefix_key_document_with_upstreams_ids(data):
    root, texts = data["root"], data["texts"]
    names = sorted(p.name for p in root.iterdir() if p.suffix in (".bin", ".idx", ".json") and p.name != "corpus")
    assert names == sorted(f"{p}_{k}_document.{s}" for p, k in (("hf", "text"), ("hf", "title"), ("spm", "text"))
                           for s in ("bin", "idx", "json")), names
    hf = upstream_tokenizer("HuggingFaceTokenizer", data["hf"])
    titles = [t.split("\n")[0][:30] for t in texts]
    # one dataset per key, each document ending with the tokenizer's eod (--append-eod)
    assert documents_of(root / "hf_text_document") == [hf.tokenize(t) + [hf.eod] for t in texts]
    assert documents_of(root / "hf_title_document") == [hf.tokenize(t) + [hf.eod] for t in titles]
    spm = upstream_tokenizer("SentencePieceTokenizer", data["spm"])
    assert documents_of(root / "spm_text_document") == [spm.tokenize(t) for t in texts]  # no --append-eod
    metadata = json.loads((root / "hf_text_document.json").read_text())
    assert (metadata["tokenizer_type"], metadata["tokenizer_model"], metadata["vocab_size"], metadata["eod_id"],
            metadata["append_eod"]) == ("HuggingFaceTokenizer", str(data["hf"]), hf.vocab_size, hf.eod, True)
    assert json.loads((root / "spm_text_document.json").read_text())["append_eod"] is False


ARGUMENTS = """
    import contextlib, io, os, sys
    from megatron_mtp import arguments
    from megatron.training.global_vars import unset_global_variables
    for name, world, argv in CASES:
        os.environ["WORLD_SIZE"] = str(world)
        sys.argv = ["pretrain_gpt_mtp.py", "--dry-run", *argv]
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse()
        unset_global_variables()
        errors = [line for line in stderr.getvalue().splitlines() if line.startswith("pretrain_gpt_mtp.py: error")]
        print("CASE", repr((name, None if args is None else (args.tokenizer_type, args.padded_vocab_size,
                                                     args.create_attention_mask_in_dataloader), errors)))
"""


def test_arguments_tokenizer_flags_attention_mask_and_schedule_plan(data):
    root = data["root"]
    base = [*TINY, "--lr", "1e-3", "--train-iters", "2"]
    hf = ["--data-path", str(root / "hf_text_document")]
    mock = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    moe = ["--num-experts", "2", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
           "--overlap-moe-expert-parallel-comm"]
    cases = [
        ("hf", 1, [*base, *hf, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(data["hf"])]),
        ("spm on hf data", 1, [*base, *hf, "--tokenizer-type", "SentencePieceTokenizer",
                               "--tokenizer-model", str(data["spm"])]),
        ("metadata", 1, [*base, *hf]),
        ("mask", 1, [*base, *mock, "--create-attention-mask-in-dataloader"]),
        ("overlap with mtp", 2, [*base, *mock, *moe, "--mtp-num-layers", "1"]),
        ("overlap on cpu", 2, [*base, *mock, *moe]),
    ]
    result = python(f"CASES = {cases!r}\n" + textwrap.dedent(ARGUMENTS))
    assert result.returncode == 0, result.stderr[-3000:]
    import ast

    cases = [ast.literal_eval(line[len("CASE "):]) for line in result.stdout.splitlines() if line.startswith("CASE ")]
    found = {case[0]: case[1:] for case in cases}
    # the tokenizer the data was written with, built as Megatron-LM builds it (400 padded to 512)
    assert found["hf"] == (("HuggingFaceTokenizer", 512, False), []), found["hf"]
    assert found["metadata"] == (("NullTokenizer", 512, False), []), found["metadata"]
    assert found["mask"] == (("NullTokenizer", 384, True), []), found["mask"]
    refused, errors = found["spm on hf data"]
    assert refused is None and len(errors) == 1, found
    assert "vocabulary 400, end of document 2) but --tokenizer-type SentencePieceTokenizer" in errors[0], errors
    assert "vocabulary 300" in errors[0] and "its ids would not match" in errors[0], errors
    refused, errors = found["overlap with mtp"]
    assert refused is None and len(errors) == 1 and "bypasses this project's exact MTP step" in errors[0], found
    refused, errors = found["overlap on cpu"]
    assert refused is None and len(errors) == 1, found
    assert "--overlap-moe-expert-parallel-comm needs a CUDA kernel and this machine has no CUDA" in errors[0], errors


def test_forward_step_takes_upstreams_return_schedule_plan():
    import inspect

    import pretrain_gpt_mtp

    parameter = inspect.signature(pretrain_gpt_mtp.forward_step).parameters["return_schedule_plan"]
    assert parameter.default is False


@pytest.mark.slow
def test_training_with_megatron_lm_tokenizer_flags_on_an_upstream_named_dataset(data):
    run = train(2, *TINY, "--lr", "1e-3", "--train-iters", "2", "--mtp-num-layers", "1",
                "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(data["hf"]),
                "--data-path", str(data["root"] / "hf_text_document"), "--split", "100,0,0")
    assert sorted(run.iterations) == [1, 2], run.tail()
    for values in run.iterations.values():
        assert math.isfinite(values["lm loss"]) and math.isfinite(values["mtp_1 loss"]), values
