# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The project's decoder on the engine tier's checkpoint (tests/test_engine.py): per prompt, greedy
plain decoding and speculative decoding with each draft chain at each depth, and the smallest margin
between the two largest logits of any argmax the decode took (a tie within the engine's round-off
may go either way there, so the test compares only prompts whose decisions are clear)."""

import torch

from megatron_mtp.serving import files, speculative
from megatron_mtp.serving import model as serving_model


def decode(checkpoint: str, prompts: list, new_tokens: int, depths: list) -> dict:
    torch.set_grad_enabled(False)
    run_args, directory = files.read_arguments(checkpoint)
    serving_model.setup()
    model = serving_model.build(run_args)
    serving_model.load(model, str(directory))
    runner = serving_model.Runner(model, int(run_args.vocab_size or run_args.padded_vocab_size))
    margins = []

    def choose(logits, first_position):
        top = logits.float().topk(2, dim=-1).values
        margins.append(float((top[:, 0] - top[:, 1]).min()))
        return logits.argmax(-1).tolist()

    out = {"plain": [], "margin": []}
    for prompt in prompts:
        margins.clear()
        out["plain"].append(speculative.greedy(runner, prompt, new_tokens, choose=choose))
        for chain in speculative.CHAINS:
            for depth in depths:
                stats = speculative.Stats(depths=depth)
                tokens = speculative.speculative(runner, prompt, new_tokens, stats, depths=depth, choose=choose,
                                                 chain=chain)
                out.setdefault(f"{chain} {depth}", []).append(
                    {"tokens": tokens, "drafts": stats.drafts, "accepted per position": stats.accepted_per_position})
        out["margin"].append(min(margins))
    return out
