# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Cost of cutting a step into chunks: k = 4 chunks vs k = 1, side by side in one run.

    .venv/bin/python -m benchmarks.split_step_bench

One process (gloo world of one), a small GPT with 2 MTP depths, 8 micro-batches per step.
The two variants alternate step by step on the same model and data; medians and their
ratio are printed (target <= 1.05: chunking adds no work beyond the forward/backward).
"""

import os
import statistics
import time
import warnings

warnings.filterwarnings("ignore")


def main(rounds: int = 10):
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29300 + os.getpid() % 500))
    dist.init_process_group("gloo")
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.fork.mtp.step import SplitStep
    from megatron_mtp.library.batches import rank_microbatches
    from megatron_mtp.library.initialize import initialize_model_parallel
    from megatron_mtp.library.model import build_model
    from megatron_mtp.library.step import global_counts, gpt_forward_step

    initialize_model_parallel(1, 1, None, 1234)
    seq, vocab = 128, 4096
    config = TransformerConfig(num_layers=2, hidden_size=128, num_attention_heads=4, mtp_num_layers=2,
                               mtp_detach_heads=True, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, calculate_per_token_loss=True)
    chunks = build_model(config, vocab, seq)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), chunks)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (16, seq + 1), generator=g)
    mask = (torch.rand(16, seq, generator=g) > 0.2).float()
    microbatches = rank_microbatches(tokens, mask, 2)

    def one_step(k):
        step = SplitStep(chunks, optimizer, gpt_forward_step, seq_length=seq, micro_batch_size=2)
        step.begin(global_counts(microbatches)[0])
        per = len(microbatches) // k
        for i in range(0, len(microbatches), per):
            step.accumulate(microbatches[i:i + per])
        return step.finish()

    for k in (1, 4):
        one_step(k)  # warm-up
    times = {1: [], 4: []}
    for _ in range(rounds):
        for k in (1, 4):
            start = time.perf_counter()
            one_step(k)
            times[k].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"8 micro-batches of 2 x {seq} tokens, D=2, isolated; median of {rounds} alternating steps")
    print(f"  k=1 chunk : {med[1] * 1000:8.1f} ms/step")
    print(f"  k=4 chunks: {med[4] * 1000:8.1f} ms/step")
    print(f"  ratio k=4 / k=1: {med[4] / med[1]:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
