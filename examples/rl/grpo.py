#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A small GRPO-style RL loop on the library: speculative rollouts drafted by the policy's own MTP heads.

    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --heads online --out runs/rl/online
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --heads none --out runs/rl/none
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --policy qwen3_5 --context-parallel-size 2
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --policy mimo --engine vllm --out runs/rl/vllm

After --sft-steps supervised steps on correct answers, each RL step runs as AReaL's GRPO with
online-trained MTP heads does, on CPU:

1. rollout (rollout.py; vllm_rollout.py with --engine vllm): the rollout engine takes the policy's
   weights from the weight stream and samples G responses per prompt at temperature 1, drafted by
   the MTP heads;
2. rewards (rewards.py): the task's exact rewards (task.py: string reversal), group-normalized;
3. step (step.py): one exact optimizer step of the policy gradient, the heads trained detached
   (--heads online), kept as after the warm start (frozen) or absent (none);
4. report (report.py): one line in the trainer's console format (rank 0); --out DIR keeps the lines
   (console.log) and summary.json. Progress goes to stderr.

The policy is policy.py's (--policy). docs/evidence.md (section 2, the RL loop) says the rest: each
engine and draft mode, what a line holds, which runs keep one trajectory, and what they show.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if not __package__:  # run as a script (torchrun examples/rl/grpo.py): its modules from this checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from examples.rl import policy, report, rewards
from examples.rl.rollout import DecoderRollouts
from examples.rl.step import replica_share, train_step
from examples.rl.task import Reversal

PROG = "grpo.py"


def parse(argv=None):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=("llama", "qwen3_5", "mimo"), default="llama",
                        help="a Llama, a tiny Qwen3.5-MoE (Gated DeltaNet, gated attention, MoE with aux_loss), or "
                             "a MiMo (Qwen2 with MTP: what vLLM's CPU build drafts for, --engine vllm)")
    parser.add_argument("--engine", choices=("decoder", "vllm"), default="decoder",
                        help="roll out with the project's decoder (per rank), or with vLLM's CPU build in its own "
                             "processes on rank 0, its weights pushed in place every step (--policy mimo)")
    parser.add_argument("--rollouts", choices=("speculative", "plain"), default=None,
                        help="--engine vllm: sample the rollouts with the heads drafting, in one engine (the "
                             "default), or by plain sampling beside a greedy drafting engine (the coupled "
                             "comparison: online, frozen and no heads keep one trajectory)")
    parser.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default=None,
                        help="--rollouts speculative: vLLM's draft_sample_method, drafts argmax q accepted with "
                             "p(draft) (greedy, vLLM's default) or drafts from q accepted with min(1, p / q)")
    parser.add_argument("--weight-bucket-mb", type=float, default=64.0,
                        help="--engine vllm: the weight stream's batches into the engine, at most this many MiB")
    parser.add_argument("--rows", choices=("padded", "packed"), default=None,
                        help="one response per row (padded), or --micro-batch-size responses per packed THD row "
                             "(default: padded for llama, packed for qwen3_5)")
    parser.add_argument("--context-parallel-size", type=int, default=1,
                        help="cut every sequence over this many ranks (packed: each padded to a multiple of 2 x CP)")
    parser.add_argument("--heads", choices=("online", "frozen", "none"), default="online")
    parser.add_argument("--mtp-loss-type", choices=("ce", "kl", "tv", "e2e_tv"), default="ce",
                        help="what the heads train toward (spec section 12): the rollout token (ce) or the "
                             "policy's own distribution at temperature 1 (kl, tv, e2e_tv)")
    parser.add_argument("--mtp-positive-advantage", action="store_true",
                        help="train the heads on responses with a positive advantage only (the MTP-only "
                             "sample mask of spec section 12)")
    parser.add_argument("--depths", type=int, default=2, help="MTP depths (with --heads online or frozen)")
    parser.add_argument("--steps", type=int, default=40, help="RL steps")
    parser.add_argument("--sft-steps", type=int, default=30, help="supervised warm-start steps")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8, help="responses sampled per prompt")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch (packed: responses "
                        "per row, one row per micro-batch)")
    parser.add_argument("--main-loss-level", choices=("token", "sequence"), default="sequence")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--length", type=int, default=5, help="letters to reverse")
    parser.add_argument("--alphabet", type=int, default=8)
    parser.add_argument("--num-layers", type=int, default=None,
                        help="default 2 (llama), 4 (qwen3_5: a multiple of 4, one full-attention layer in four)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="directory for console.log and summary.json")
    args = parser.parse_args(argv)
    args.rows = args.rows or ("packed" if args.policy == "qwen3_5" else "padded")
    args.num_layers = args.num_layers or (4 if args.policy == "qwen3_5" else 2)
    if args.policy == "qwen3_5" and args.num_layers % 4:
        parser.error(f"--num-layers {args.num_layers}: the qwen3_5 policy's layers come in fours")
    for name in ("steps", "prompts_per_step", "group_size", "micro_batch_size", "depths", "context_parallel_size",
                 "num_layers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.rows == "padded" and (2 * args.length + 2) % (2 * args.context_parallel_size):
        parser.error(f"--context-parallel-size {args.context_parallel_size} with --rows padded: a row of "
                     f"{2 * args.length + 2} positions does not split into 2 x CP chunks (give --length so "
                     "that 2 x length + 2 does, or --rows packed)")
    if args.sft_steps < 0:
        parser.error("--sft-steps must be >= 0")
    if args.engine == "decoder":
        for name in ("rollouts", "draft_sample_method"):
            if getattr(args, name) is not None:
                parser.error(f"--{name.replace('_', '-')} with --engine decoder: the decoder's rollouts are "
                             "Gumbel-coupled speculative sampling (--engine vllm chooses)")
    if args.engine == "vllm":
        from megatron_mtp.serving.engines import vllm_engine

        args.rollouts = args.rollouts or "speculative"
        if args.draft_sample_method is not None and (args.rollouts == "plain" or args.heads == "none"):
            parser.error(f"--draft-sample-method with --rollouts {args.rollouts} --heads {args.heads}: no rollout "
                         "is drafted (--rollouts speculative with heads)")
        if args.rollouts == "speculative" and args.heads != "none":
            args.draft_sample_method = args.draft_sample_method or "greedy"  # vLLM's default

        if args.policy != "mimo":
            parser.error(f"--engine vllm with --policy {args.policy}: vLLM's CPU build drafts with MTP heads for "
                         "--policy mimo here (docs/serving.md, the families table)")
        if args.hidden_size < 64:
            parser.error(f"--engine vllm with --hidden-size {args.hidden_size}: vLLM's CPU attention needs heads of "
                         "at least 32 (the mimo policy has 2 heads): give 64 or more")
        if not vllm_engine.available():
            parser.error(f"--engine vllm: no vLLM at {vllm_engine.python()}: run `bash tools/bootstrap --engine vllm`")
    if args.weight_bucket_mb <= 0:
        parser.error("--weight-bucket-mb must be > 0")
    return args


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def warm_start(chunks, optimizer, task, args, dp: int, dp_rank: int) -> None:
    """Supervised steps on correct answers (advantage 1: the policy-gradient loss is the CE): a start
    that RL improves on, and heads with something to draft."""
    for step in range(args.sft_steps):
        prompts = task.prompts(args.prompts_per_step * args.group_size, args.seed + 1, step)
        share = len(prompts) // dp
        batch = [p + task.answer(p) for p in prompts[dp_rank * share:(dp_rank + 1) * share]]
        metrics = train_step(chunks, optimizer, batch, [1.0] * len(batch), task, args)
        if (step + 1) % 10 == 0 or step + 1 == args.sft_steps:
            progress(f"warm-start step {step + 1}/{args.sft_steps}: lm loss {metrics.main_loss:.4f}")


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.set_num_threads(1)
    task = Reversal(args.length, args.alphabet)
    chunks, optimizer, depths, policy_args, rollout_model = policy.build(args, task)
    from megatron.core import parallel_state

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    engines = dist.get_world_size()  # every rank runs a rollout engine
    if args.prompts_per_step % engines:
        raise SystemExit(f"{PROG}: error: --prompts-per-step {args.prompts_per_step} must split into {engines} "
                         "rollout engines (one per rank)")
    model = chunks[0].module
    share = args.prompts_per_step // engines
    mine = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    out = Path(args.out) if args.out else None
    console = report.Console(out, task)

    warm_start(chunks, optimizer, task, args, dp, dp_rank)
    frozen = policy.FrozenHeads(model) if args.heads == "frozen" else None
    heads_after_warm_start = policy.digest(model, heads=True)
    decoder = DecoderRollouts(rollout_model, task, args, depths)  # this rank's: its engine view in every run
    vllm = None
    if args.engine == "vllm":
        from examples.rl.vllm_rollout import VllmRollouts

        vllm = VllmRollouts(chunks, policy_args, depths, task, args, out)
    engine = decoder if vllm is None else vllm  # what samples the rollouts
    try:  # the engines' processes end with the run, however it ends
        rewards_per_step, synced, differences, pushed, started = [], [], [], [], time.perf_counter()
        for step in range(1, args.steps + 1):
            every_prompt = task.prompts(args.prompts_per_step, args.seed, step)
            synced.append(decoder.refresh(chunks, policy_args))  # the rollouts sample the policy as it is now
            differences.append(decoder.largest_difference(model))
            if vllm is not None:
                pushed.append(vllm.push())  # the engines sample and draft with the policy as it is now
            rollouts = engine.sample(every_prompt, step, mine)
            view = decoder.engine_view(every_prompt, step, mine)
            scored = rewards.score(task, every_prompt[mine], rollouts.responses, args.group_size)
            sequences, advantages = replica_share(scored.sequences, scored.advantages, dp, dp_rank)
            metrics = train_step(chunks, optimizer, sequences, advantages, task, args)
            if frozen is not None:
                frozen.restore()
            greedy = None  # vLLM's greedy speculative decode beside the decoder's with vLLM's chain
            if args.rollouts == "plain" and depths:
                greedy = (vllm.greedy_acceptance(every_prompt), decoder.greedy_acceptance(every_prompt[mine]))
            printed = report.StepReport.over_ranks(step * args.prompts_per_step * args.group_size, scored.rewards,
                                                   rollouts, args.engine, view, greedy, metrics)
            rewards_per_step.append(printed.reward)
            console.write(printed.line(step, args.steps))
            elapsed = time.perf_counter() - started
            progress(f"RL step {step}/{args.steps}: reward {printed.reward:.4f}, ETA "
                     f"{time.strftime('%H:%M:%S', time.gmtime(elapsed / step * (args.steps - step)))}")
    finally:
        if vllm is not None:
            vllm.close()

    summary = {"heads": args.heads, "depths": depths, "mtp loss type": args.mtp_loss_type, "rewards": rewards_per_step,
               "backbone sha256": policy.digest(model, heads=False), "heads sha256 after warm start":
               heads_after_warm_start, "heads sha256": policy.digest(model, heads=True),
               # per RL step: whether the rollout model held the streamed weights bit for bit after the push
               "rollout model synced": synced, "rollout model largest difference from the policy": differences,
               "arguments": vars(args)}
    if vllm is not None:  # per RL step: the bytes the weight stream pushed into vLLM's engines (rank 0)
        summary["bytes pushed into vllm"] = pushed
        summary["vllm rollout engine"] = vllm.rollout_engine()
    if dist.get_rank() == 0 and out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    console.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
