# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Speculative decoding by whole-sequence recompute: every forward runs from position 0 (the
Runner's KV cache is cut back to nothing each time), so no state is carried between steps.
What megatron_mtp.serving.speculative computes over its KV cache must equal this, draft for
draft; benchmarks/speculative_decoding_bench.py measures the two side by side."""

import torch


def draft(runner, hidden0: torch.Tensor, seq: list[int], depths: int) -> list[int]:
    """Depths 1..D after `seq`, from h^0 of seq[:-1]: depth k at every position t' <= t reads
    h^{k-1}_{t'} and x_{t'+k} (the drafts where those lie past the accepted tokens)."""
    drafts = []
    hidden = hidden0
    tokens = list(seq)
    length = hidden.shape[0]
    for k in range(1, depths + 1):
        hidden, logits = runner.depth(k, hidden, torch.tensor([tokens[k: k + length]]), start=0)
        drafts.append(int(logits[0, -1].argmax()))
        tokens.append(drafts[-1])
    return drafts


def speculative(runner, prompt: list[int], new_tokens: int, depths: int) -> tuple[list[int], list[list[int]]]:
    """(the output, the drafts proposed at every step)."""
    hidden, logits = runner.main(torch.tensor([prompt]), start=0)
    seq = list(prompt) + [int(logits[0, -1].argmax())]
    proposed = [draft(runner, hidden, seq, depths)] if new_tokens > 1 else []
    while len(seq) - len(prompt) < new_tokens:
        drafts = proposed[-1]
        hidden, logits = runner.main(torch.tensor([seq + drafts]), start=0)
        greedy = logits[0].argmax(-1).tolist()
        base, accepted = len(seq) - 1, 0
        while accepted < len(drafts) and drafts[accepted] == greedy[base + accepted]:
            accepted += 1
        seq += drafts[:accepted] + [greedy[base + accepted]]
        if len(seq) - len(prompt) < new_tokens:  # drafts only for a step that will verify them
            proposed.append(draft(runner, hidden[: len(seq) - 1], seq, depths))
    return seq[len(prompt): len(prompt) + new_tokens], proposed


def greedy(runner, prompt: list[int], new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new_tokens):
        _, logits = runner.main(torch.tensor([seq]), start=0)
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]
