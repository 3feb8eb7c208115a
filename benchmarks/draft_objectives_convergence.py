# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What each draft objective gains on a fixed policy: the sampled and greedy-draft acceptances its heads reach.

    .venv/bin/python -m benchmarks.draft_objectives_convergence [--steps 150] [--optimizer adam|sgd] [--objectives ...]

A small GPT (4 layers, hidden 64, vocabulary 48, one MTP depth, isolated) with a frozen backbone
whose output weight is spread (a policy far from uniform) generates sequences by sampling at
temperature 1, fresh every step; its MTP head trains on them from the same initial weights with
each objective (spec section 12): ce against the sampled tokens, kl, tv and e2e_tv against the
policy's own distribution. Printed: the step's `mtp_1 sampled acceptance` (the mean of
sum_v min(p, q) on that step's sequences, before its update: what vLLM's opt-in probabilistic
drafts are accepted with) every 15 steps, and the mean of the last 10; then the same for
`mtp_1 greedy-draft acceptance` (the mean of p(argmax q): what vLLM's default greedy drafts are
accepted with, spec section 12.1). ce's expected gradient is kl's (the sampled token is drawn
from p), but each step sees one token per position where kl sees the whole distribution.
"""

import argparse
import warnings

warnings.filterwarnings("ignore")

from benchmarks.common import setup_process

VOCAB, SEQ, BATCH = 48, 12, 16
OBJECTIVES = ("ce", "kl", "tv", "e2e_tv")


def train_heads(objective: str, optimizer_name: str, steps: int) -> tuple[list[float], list[float]]:
    import torch
    from megatron.core.transformer import multi_token_prediction
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.fork.mtp.statistics import GREEDY_ACCEPTED, SAMPLED_ACCEPTED, STEP_STATISTICS, VALID
    from megatron_mtp.library.model import build_gpt

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, mtp_num_layers=1,
                               mtp_detach_heads=True, mtp_loss_type=objective, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, calculate_per_token_loss=True)
    model = build_gpt(config, VOCAB, SEQ)
    with torch.no_grad():
        model.output_layer.weight.mul_(4.0)
    heads = [p for n, p in model.named_parameters() if n.startswith("mtp.")]
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("mtp."))
    optimizer = torch.optim.Adam(heads, lr=2e-3) if optimizer_name == "adam" else torch.optim.SGD(heads, lr=0.5)
    generator = torch.Generator().manual_seed(1)
    accepted, greedy = [], []
    for _ in range(steps):
        tokens = torch.randint(1, VOCAB, (BATCH, 1), generator=generator)
        model.eval()
        with torch.no_grad():  # the policy's own samples, at temperature 1
            for _ in range(SEQ):
                positions = torch.arange(tokens.size(1)).unsqueeze(0).expand_as(tokens)
                logits = model(tokens, positions, None)[:, -1].float()
                tokens = torch.cat([tokens, torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)], 1)
        model.train()
        inputs, labels, mask = tokens[:, :-1], tokens[:, 1:], torch.ones(BATCH, SEQ)
        multi_token_prediction.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / mask.sum()))
        STEP_STATISTICS.reset()
        optimizer.zero_grad()
        positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
        with STEP_STATISTICS.report_metrics():  # read below (ce measures them only when asked)
            per_token = model(inputs, positions, None, labels=labels, loss_mask=mask)
        (per_token * mask).sum().mul(0.0).backward()  # the backbone is frozen: only the MTP branch trains
        optimizer.step()
        sums = STEP_STATISTICS.local_sums()
        accepted.append(float(sums[0, SAMPLED_ACCEPTED] / sums[0, VALID]))
        greedy.append(float(sums[0, GREEDY_ACCEPTED] / sums[0, VALID]))
    return accepted, greedy


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES),
                        help="which objectives to train (each from the same start; default: all)")
    args = parser.parse_args()
    setup_process()
    print(f"mtp_1 sampled acceptance (alpha) and greedy-draft acceptance (beta) every 15 steps ({args.optimizer}, "
          f"{args.steps} steps), then the last 10's mean:")
    for objective in args.objectives:
        for name, values in zip(("alpha", "beta"), train_heads(objective, args.optimizer, args.steps), strict=True):
            print(f"  {objective:7s} {name:5s} " + " ".join(f"{a:.3f}" for a in values[::15])
                  + f" | last 10: {sum(values[-10:]) / 10:.3f}", flush=True)


if __name__ == "__main__":
    main()
