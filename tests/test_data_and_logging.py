# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Data in, metrics out: tools/preprocess_data.py, blends, splits, mock data, evaluation,
and the console, TensorBoard and W&B (offline) metrics of a pretrain_gpt_mtp.py run.

Tokenizers are trained here from the test corpus (a Hugging Face BPE tokenizer.json and a
SentencePiece model), so nothing is downloaded; the ids a dataset holds must be exactly
the tokenizer's ids of each document followed by its end-of-document id.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from tests.harness.corpora import paragraphs, write_jsonl
from tests.harness.launcher import REPO_ROOT
from tests.harness.trainer import TINY, scalars, train


def preprocess(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)


def documents_of(prefix: Path) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, list[str]]:
    texts = paragraphs(400)
    root = tmp_path_factory.mktemp("jsonl")
    lines = [json.dumps({"body": t}) for t in texts[:200]] + ["not json", json.dumps({"title": "no body"}), ""] + \
        [json.dumps({"body": t}) for t in texts[200:]]
    path = root / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, texts


@pytest.fixture(scope="module")
def tokenizer_json(corpus, tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus[1], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def sentencepiece_model(corpus, tmp_path_factory) -> Path:
    import sentencepiece

    root = tmp_path_factory.mktemp("spm")
    (root / "text.txt").write_text("\n".join(corpus[1]))
    sentencepiece.SentencePieceTrainer.train(input=str(root / "text.txt"), model_prefix=str(root / "spm"),
                                             vocab_size=300, model_type="bpe", minloglevel=2)
    return root / "spm.model"


@pytest.mark.matrix  # bytes: every trainer test's dataset; several workers: test_a_local_tokenizer_json
def test_bytes_with_a_configurable_key_skipped_lines_and_several_workers(corpus, tmp_path):
    path, texts = corpus
    one = preprocess("--input", str(path), "--output-prefix", str(tmp_path / "one"), "--tokenizer", "bytes",
                     "--json-key", "body")
    assert one.returncode == 0, one.stderr
    assert "wrote" in one.stdout and f"{len(texts)} documents" in one.stdout
    assert "skipped 2 line(s): line 201: not JSON" in one.stdout and "line 202: no string field 'body'" in one.stdout
    two = preprocess("--input", str(path), "--output-prefix", str(tmp_path / "two"), "--tokenizer", "bytes",
                     "--json-key", "body", "--workers", "2", "--log-interval", "100")
    assert two.returncode == 0, two.stderr
    assert "100 documents" in two.stderr  # progress
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"two{suffix}").read_bytes()
    metadata = json.loads((tmp_path / "one.json").read_text())
    assert (metadata["tokenizer"], metadata["vocab_size"], metadata["eod_id"]) == ("bytes", 257, 256)
    assert documents_of(tmp_path / "one") == [list(t.encode()) + [256] for t in texts]


def test_a_local_tokenizer_json(corpus, tokenizer_json, tmp_path):
    from tokenizers import Tokenizer

    path, texts = corpus
    result = preprocess("--input", str(path), "--output-prefix", str(tmp_path / "hf"), "--tokenizer",
                        str(tokenizer_json), "--json-key", "body", "--workers", "2")
    assert result.returncode == 0, result.stderr
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    eod = tokenizer.token_to_id("</s>")
    metadata = json.loads((tmp_path / "hf.json").read_text())
    assert (metadata["vocab_size"], metadata["eod_id"]) == (tokenizer.get_vocab_size(), eod)
    assert documents_of(tmp_path / "hf") == [tokenizer.encode(t, add_special_tokens=False).ids + [eod]
                                             for t in texts]


@pytest.mark.matrix  # a tokenizer file in the default tier: test_a_local_tokenizer_json
def test_a_sentencepiece_model(corpus, sentencepiece_model, tmp_path):
    import sentencepiece

    path, texts = corpus
    result = preprocess("--input", str(path), "--output-prefix", str(tmp_path / "spm"), "--tokenizer",
                        str(sentencepiece_model), "--json-key", "body")
    assert result.returncode == 0, result.stderr
    model = sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model))
    metadata = json.loads((tmp_path / "spm.json").read_text())
    assert (metadata["vocab_size"], metadata["eod_id"]) == (model.get_piece_size(), model.eos_id())
    assert documents_of(tmp_path / "spm") == [model.encode(t) + [model.eos_id()] for t in texts]


# Each case is a launch of the tool (about 10 s: it imports Megatron-LM's argument parser). The
# default tier keeps the refusal before any work and the one after the writers started.
@pytest.mark.parametrize("cases", [
    pytest.param(("missing input", "no string field"), id="input"),
    pytest.param(("missing tokenizer", "unreadable tokenizer"), id="tokenizer", marks=pytest.mark.matrix),
])
def test_bad_input_is_one_line_and_leaves_no_files(cases, corpus, tmp_path):
    path, _ = corpus
    not_a_tokenizer = tmp_path / "broken.json"
    not_a_tokenizer.write_text("{}")
    every_case = {
        "missing input": (("--input", str(tmp_path / "none.jsonl"), "--tokenizer", "bytes"), "does not exist"),
        "missing tokenizer": (("--input", str(path), "--tokenizer", str(tmp_path / "missing.json")),
                              "neither 'bytes' nor an existing file"),
        "unreadable tokenizer": (("--input", str(path), "--tokenizer", str(not_a_tokenizer)),
                                 "is not a readable tokenizer.json"),
        "no string field": (("--input", str(path), "--tokenizer", "bytes", "--json-key", "nothing"),
                            "no document with a string field"),
    }
    for args, expected in (every_case[name] for name in cases):
        result = preprocess(*args, "--output-prefix", str(tmp_path / "out"))
        assert result.returncode == 2, (args, result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("preprocess_data: error: ") and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.json"]


@pytest.mark.slow
def test_training_on_a_blend_reports_every_metric_to_console_tensorboard_and_wandb(corpus, tokenizer_json,
                                                                                  tmp_path):
    path, texts = corpus
    for name, part in (("first", texts[:250]), ("second", texts[250:])):
        write_jsonl(tmp_path / f"{name}.jsonl", part)
        result = preprocess("--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                            "--tokenizer", str(tokenizer_json))
        assert result.returncode == 0, result.stderr
    run = train(2, *TINY, "--lr", "1e-3", "--train-iters", "4", "--mtp-num-layers", "2", "--mtp-detach-heads",
                "--data-path", "0.7", str(tmp_path / "first"), "0.3", str(tmp_path / "second"),
                "--split", "90,5,5", "--eval-interval", "2", "--eval-iters", "2",
                "--data-cache-path", str(tmp_path / "cache"),
                "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "megatron-mtp-test",
                "--wandb-exp-name", "blend", "--wandb-save-dir", str(tmp_path / "wandb"),
                env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert "vocab (size: 400)" in run.output  # the tokenizer.json's vocabulary, from the dataset
    line = run.iterations[4]
    for field in ("lm loss", "mtp_1 loss", "mtp_2 loss", "mtp_1 acceptance", "mtp_2 chain acceptance",
                  "expected accepted length (incl. bonus token)", "grad norm", "mtp grad norm", "learning rate",
                  "tokens/s", "mtp_2 sampled acceptance", "mtp_2 greedy-draft acceptance",
                  "expected accepted length (sampling)", "expected accepted length (greedy drafts)"):
        assert field in line, (field, sorted(line))
    assert "ETA: " in run.output
    assert 0 < line["expected accepted length (incl. bonus token)"] - 1 <= 2
    check_expected_accepted_length(run.iterations, scalars(tmp_path / "tb"), depths=2)
    check_blend_and_split(tmp_path / "cache", {str(tmp_path / "first"): (0.7, 250),
                                               str(tmp_path / "second"): (0.3, 150)},
                          (0.90, 0.05, 0.05), train_samples=4 * 8)
    for iteration in (2, 4):  # evaluation reports the MTP metrics too
        validation = run.validations[iteration]
        assert {"lm loss", "mtp_1 loss", "mtp_2 acceptance", "mtp_2 chain acceptance", "mtp_2 sampled acceptance",
                "mtp_2 greedy-draft acceptance", "expected accepted length (greedy drafts)"} <= set(validation), \
            validation

    tags = scalars(tmp_path / "tb")
    for tag in ("lm loss", "grad-norm", "mtp grad norm", "mtp_1 loss", "mtp_2 acceptance", "mtp_2 chain acceptance",
                "expected accepted length (incl. bonus token)", "mtp_1 acceptance (cumulative)",
                "mtp_1 loss validation", "mtp_2 acceptance validation", "tokens per second",
                "mtp_1 greedy-draft acceptance", "mtp_1 greedy-draft acceptance (cumulative)",
                "expected accepted length (greedy drafts)", "mtp_2 greedy-draft acceptance validation"):
        assert tag in tags, (tag, sorted(tags))
    assert sorted(tags["mtp_1 loss"]) == [1, 2, 3, 4]

    (record,) = list((tmp_path / "wandb").rglob("run-*.wandb"))
    logged = record.read_bytes()
    for key in (b"mtp_1 loss", b"mtp grad norm", b"expected accepted length (incl. bonus token)",
                b"mtp_2 acceptance validation"):
        assert key in logged, key


EXPECTED_LENGTH = "expected accepted length (incl. bonus token)"


def check_expected_accepted_length(iterations: dict, tensorboard: dict, depths: int) -> None:
    """The logged expected accepted length is 1 + the sum of the logged chain acceptances
    (spec section 7), at every iteration: exactly (float32) in TensorBoard, to the console's 4
    decimals there. Depth 1's chain acceptance is its acceptance; a deeper depth's chain
    acceptance is at most its acceptance, and the run must show one strictly below, or a
    length computed from the plain acceptances would pass as well."""
    assert len(iterations) > 0 and len(tensorboard[EXPECTED_LENGTH]) == len(iterations)
    strictly_below = False
    for step, line in iterations.items():
        chain = [line[f"mtp_{k} chain acceptance"] for k in range(1, depths + 1)]
        assert abs(line[EXPECTED_LENGTH] - (1 + sum(chain))) <= 1e-4 * (depths + 1), (step, line)
        tb_chain = [tensorboard[f"mtp_{k} chain acceptance"][step] for k in range(1, depths + 1)]
        tb_acceptance = [tensorboard[f"mtp_{k} acceptance"][step] for k in range(1, depths + 1)]
        assert abs(tensorboard[EXPECTED_LENGTH][step] - (1 + sum(tb_chain))) <= 1e-6, (step, tb_chain)
        assert tb_chain[0] == tb_acceptance[0], step
        assert all(0 <= c <= a <= 1 for c, a in zip(tb_chain, tb_acceptance)), (step, tb_chain, tb_acceptance)
        strictly_below |= any(c < a for c, a in zip(tb_chain[1:], tb_acceptance[1:]))
    assert strictly_below, "no step tells chain from plain acceptance"


def check_blend_and_split(cache: Path, datasets: dict, split: tuple, train_samples: int) -> None:
    """What the run's data actually were, from megatron-core's index cache (--data-cache-path):
    `datasets` maps each prefix to (blend weight, number of documents).

    Blend: the training samples drawn from each dataset (the blended dataset's index, read
    in order by the run) are its weight's share to within one sample. Split: each dataset's
    train, valid and test documents (its GPT datasets' document indices) are consecutive,
    disjoint ranges of documents in that order, covering all, each its share of the documents
    to within one."""
    def one(pattern: str) -> Path:
        (found,) = cache.glob(pattern)
        return found

    blend = numpy.load(one("*-BlendedDataset-train-dataset_index.npy"))
    assert train_samples <= len(blend) <= train_samples + 1  # (0.19.2 builds one sample more)
    blend = blend[:train_samples]  # read in order
    for position, (prefix, (weight, _)) in enumerate(datasets.items()):  # the blend's order
        drawn = int((blend == position).sum())
        assert abs(drawn - weight * train_samples) <= 1, (prefix, drawn, weight)
    documents = {}
    for description in cache.glob("*-GPTDataset-*-description.txt"):
        identifiers = json.loads(description.read_text())
        index = numpy.load(str(description).replace("description.txt", "document_index.npy"))
        documents[identifiers["dataset_path"], identifiers["index_split"]] = sorted(set(index.tolist()))
    assert {prefix for prefix, _ in documents} == set(datasets), sorted(documents)
    for prefix, (_, count) in datasets.items():
        start = 0
        for name, share in zip(("train", "valid", "test"), split):
            ids = documents[prefix, name]
            assert ids == list(range(start, start + len(ids))), (prefix, name)  # consecutive, in order
            assert abs(len(ids) - share * count) <= 1, (prefix, name, len(ids), share * count)
            start += len(ids)
        assert start == count, (prefix, start, count)


@pytest.mark.slow
def test_mock_data(tmp_path):
    run = train(1, *TINY, "--lr", "1e-3", "--train-iters", "2", "--mtp-num-layers", "1", "--mock-data",
                "--tokenizer-type", "NullTokenizer", "--vocab-size", "300")
    assert sorted(run.iterations) == [1, 2] and "mtp_1 loss" in run.iterations[2], run.tail()
    check_mock_run(run, iterations=2, global_batch=8, padded_vocab=384)


@pytest.mark.slow
def test_the_sampled_acceptance_a_line_prints_is_its_own_iteration_s_step(tmp_path):
    """Only a step training_log prints measures the sampled and greedy-draft acceptances (their projection costs a
    second pass over the MTP rows): with --log-interval 2 the first line (iteration 1, printed
    off the interval) has none, and the lines at 2 and 4 have the value a run printing every
    step prints for that step, whatever the interval's other steps did."""
    common = (*TINY, "--lr", "1e-3", "--train-iters", "4", "--mtp-num-layers", "2", "--mock-data",
              "--tokenizer-type", "NullTokenizer", "--vocab-size", "300")
    every = train(1, *common).iterations
    interval = train(1, *common, "--log-interval", "2").iterations
    assert sorted(interval) == [1, 2, 4], sorted(interval)
    sampled = ("mtp_1 sampled acceptance", "mtp_2 sampled acceptance", "expected accepted length (sampling)",
               "mtp_1 greedy-draft acceptance", "mtp_2 greedy-draft acceptance",
               "expected accepted length (greedy drafts)")
    assert not set(sampled) & set(interval[1]), interval[1]
    for step in (2, 4):
        assert {name: interval[step][name] for name in sampled} == {name: every[step][name] for name in sampled}, step
    # the interval's other metrics are over both its steps: the line differs from the step's own
    assert interval[4]["mtp_1 loss"] != every[4]["mtp_1 loss"]


def check_mock_run(run, iterations: int, global_batch: int, padded_vocab: int) -> None:
    """The run trained on megatron-core's mock GPT data, sized by the run, every step counted,
    with real losses: an untrained model's cross-entropy over the padded vocabulary is near
    ln(vocab) (measured 5.84 to 5.99 for ln 384 = 5.95), for the main head and depth 1."""
    import math

    assert f"Building MockGPTDataset splits with sizes=({iterations * global_batch}, " in run.output
    assert sorted(run.iterations) == list(range(1, iterations + 1))
    for step, line in run.iterations.items():
        assert line["consumed samples"] == step * global_batch and line["global batch size"] == global_batch
        assert line["number of skipped iterations"] == 0 and line["number of nan iterations"] == 0, line
        for loss in ("lm loss", "mtp_1 loss"):
            assert abs(line[loss] - math.log(padded_vocab)) < 0.5, (step, loss, line[loss])
        assert 0 <= line["mtp_1 chain acceptance"] == line["mtp_1 acceptance"] <= 1
        assert abs(line[EXPECTED_LENGTH] - 1 - line["mtp_1 chain acceptance"]) <= 2e-4, line
