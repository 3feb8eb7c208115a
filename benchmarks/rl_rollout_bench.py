# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Speculative rollouts against plain sampling, side by side, on the RL example's policy made deep:
8 decoder layers and one MTP depth, as served models are (a draft costs one layer, a target
forward eight).

    .venv/bin/python benchmarks/rl_rollout_bench.py [--sft-steps 60] [--prompts 32] [--rounds 3]

The policy of examples/rl/grpo.py (string reversal) is warm-started by --sft-steps supervised
steps (its MTP depth trains beside it, detached), then the same prompts are sampled at
temperature 1 both ways, taking turns prompt by prompt: plain sampling (one target forward per
token) and speculative decoding (the depth drafts, the main head verifies). Both use the
Gumbel-coupled sampler keyed by (seed, response, position), so both sides' tokens are equal
(checked). Printed: each side's seconds per generated token (medians over rounds) and their
ratio; the speculative side's target forwards per token and mean acceptance length; and, to say
where the time goes, the cost of one target forward of 1 and of 2 tokens over the KV cache.
"""

import argparse
import os
import statistics
import time
import warnings


def timed(function, repeats: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    from examples.rl import grpo, policy
    from examples.rl.rollout import DecoderRollouts
    from examples.rl.step import train_step
    from examples.rl.task import EOS, Reversal
    from megatron_mtp.serving import speculative

    torch.set_num_threads(1)
    args = grpo.parse(["--num-layers", "8", "--depths", "1", "--heads", "online", "--sft-steps",
                       str(options.sft_steps)])
    task = Reversal(args.length, args.alphabet)
    chunks, optimizer, depths, policy_args, rollout_model = policy.build(args, task)
    for step in range(args.sft_steps):
        prompts = task.prompts(args.prompts_per_step * args.group_size, args.seed + 1, step)
        train_step(chunks, optimizer, [p + task.answer(p) for p in prompts], [1.0] * len(prompts), task, args)
    # the rollout engine's model, given the warm-started policy by the weight stream as the example's is
    decoder = DecoderRollouts(rollout_model, task, args, depths)
    if not decoder.refresh(chunks, policy_args):
        raise SystemExit("the rollout model does not hold the streamed weights")
    runner = decoder.runner
    prompts = task.prompts(options.prompts, args.seed, 1)
    seconds = {"plain": [], "speculative": []}
    stats = speculative.Stats(depths=1)
    for _ in range(options.rounds):
        totals, tokens = {"plain": 0.0, "speculative": 0.0}, 0
        for i, prompt in enumerate(prompts):
            start = time.perf_counter()
            plain = speculative.greedy(runner, prompt, task.answer_length, choose=speculative.GumbelSampler(1, i),
                                       stop=EOS)
            totals["plain"] += time.perf_counter() - start
            start = time.perf_counter()
            drafted = speculative.speculative(runner, prompt, task.answer_length, stats,
                                              choose=speculative.GumbelSampler(1, i), stop=EOS)
            totals["speculative"] += time.perf_counter() - start
            if drafted != plain:
                raise SystemExit(f"prompt {i}: speculative {drafted} != plain {plain}")
            tokens += len(plain)
        for side in seconds:
            seconds[side].append(totals[side] / tokens)
    median = {side: statistics.median(values) for side, values in seconds.items()}
    summary = stats.summary()
    print(f"policy: {args.num_layers} layers, hidden {args.hidden_size}, 1 MTP depth, {options.sft_steps} warm-start "
          f"steps; {options.prompts} prompts x {options.rounds} rounds, {task.answer_length} tokens each at most")
    for side, value in median.items():
        print(f"  {side:12s} {value * 1000:7.2f} ms per generated token")
    print(f"  speed-up (plain / speculative): {median['plain'] / median['speculative']:.3f}")
    print(f"  speculative: {summary['target forwards per generated token']:.3f} target forwards per token, "
          f"mean acceptance length {summary['mean acceptance length incl. bonus']:.3f}")
    with torch.no_grad():
        prompt = torch.tensor([prompts[0]])
        runner.main(prompt)
        one = timed(lambda: runner.main(prompt[:, -1:], start=prompt.size(1) - 1))
        two = timed(lambda: runner.main(prompt[:, -2:], start=prompt.size(1) - 2))
    print(f"  one target forward: {one * 1000:.2f} ms for 1 token, {two * 1000:.2f} ms for 2 tokens")


if __name__ == "__main__":
    main()
