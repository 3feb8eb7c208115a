# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Exact steps from a user's own Megatron-LM entry script (issue 16): a pretrain_gpt.py-style
script (tests/harness/upstream_contract_pretrain.py: upstream's per-token loss contract, none
of this project's trainer) with the series' --exact-steps trains exactly the steps of
pretrain_gpt_mtp.py (token level): the same lm loss, MTP loss and grad norm at every
iteration (rel 2e-5), here on 2 DP ranks x 2 micro-batches against 1 rank x 4.

The model is an MoE GPT with MTP D = 1 and the data have loss-mask holes (--eod-mask-loss),
so the step's valid targets N_tok differ from its routed tokens T. Without --exact-steps
(upstream's --calculate-per-token-loss, which finalize_model_grads normalizes by N_tok) the
router losses are weighted by 1/N_tok instead of the spec's 1/T, and the grad norm differs:
the flag is what makes the user's steps exact.
"""

import pytest

from tests.harness.corpora import preprocess, sentences, write_jsonl
from tests.harness.trainer import TINY, close, scalars, train

pytestmark = pytest.mark.slow

COMMON = TINY + ("--num-layers", "2", "--mtp-num-layers", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
                 "--eod-mask-loss", "--global-batch-size", "8", "--micro-batch-size", "2", "--lr", "1e-3",
                 "--train-iters", "3", "--make-vocab-size-divisible-by", "256", "--eval-interval", "1000",
                 "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
                 "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "10",
                 "--moe-z-loss-coeff", "1", "--disable-bias-linear")  # router losses that dominate
# What pretrain_gpt_mtp.py sets by default and a user's command line gives.
USER = ("--position-embedding-type", "rope", "--calculate-per-token-loss", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "257", "--null-tokenizer-eod-id", "256")  # the dataset's bytes
COMPARED = ("lm loss", "mtp_1 loss", "grad-norm")


def test_a_users_entry_script_with_exact_steps_trains_the_spec_objective(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    data = str(preprocess(write_jsonl(root / "sentences.jsonl", sentences()), root / "sentences"))
    runs = {}
    for name, nproc, script, extra in [
        ("trainer", 1, "pretrain_gpt_mtp.py", ()),
        ("user, --exact-steps", 2, "tests/harness/upstream_contract_pretrain.py", (*USER, "--exact-steps")),
        ("user, per-token loss", 2, "tests/harness/upstream_contract_pretrain.py", USER),
    ]:
        logs = tmp_path / f"tb-{len(runs)}"
        train(nproc, *COMMON, "--data-path", data, *extra, "--tensorboard-dir", str(logs), script=script)
        runs[name] = scalars(logs)
    want = runs["trainer"]
    exact, upstream = runs["user, --exact-steps"], runs["user, per-token loss"]
    for tag in COMPARED:
        assert sorted(want[tag]) == sorted(exact[tag]) == [1, 2, 3], tag
        for step in (1, 2, 3):
            assert close(exact[tag][step], want[tag][step]), (tag, step, exact[tag][step], want[tag][step])
    # upstream's normalization of the router losses (1/N_tok) differs from the spec's (1/T)
    assert not close(upstream["grad-norm"][1], want["grad-norm"][1],
                     rel=1e-3), (upstream["grad-norm"], want["grad-norm"])
