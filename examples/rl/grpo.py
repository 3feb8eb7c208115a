#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A small GRPO-style RL loop on the library: speculative rollouts drafted by the policy's own MTP heads.

    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --heads online --out runs/rl/online
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --heads none --out runs/rl/none
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --policy qwen3_5 --context-parallel-size 2
    .venv/bin/torchrun --nproc-per-node 2 examples/rl/grpo.py --policy mimo --engine vllm --out runs/rl/vllm

The policy (--policy): a Llama (the default), or a tiny Qwen3.5-MoE: GPTModel with Gated DeltaNet
layers (three in four, --experimental-attention-variant gated_delta_net, as
examples/configs/qwen3_next_gpt_tiny.sh builds them) among gated full-attention ones with q/k
norms and partial rotary, zero-centred RMSNorms, MoE with a gated shared expert in every layer
trained with an auxiliary load-balancing loss (aux_loss), and --depths MTP depths of one
repeated layer (Qwen3.5's MTP block is one layer, which vLLM and SGLang run at every drafted
position; the stream's Qwen3-Next layout holds one). Trained on packed
rows by default (--rows packed: --micro-batch-size responses per THD row, each its own sequence
of cu_seqlens, padded to a multiple of 2 x --context-parallel-size, as RL frameworks pack), and
with --context-parallel-size 2 every sequence cut over the 2 ranks. Its rollout engine takes
Qwen3.5-MoE's Hugging Face names from the weight stream and decodes over the Gated DeltaNet
layers' recurrent and convolution states (megatron_mtp.serving.recurrent).

One step, as AReaL's GRPO with online-trained MTP heads runs it, on CPU:

1. rollouts: the rollout engine (a model of its own, as vLLM's or SGLang's is) takes the policy's
   weights from the weight stream (megatron_mtp.serving.stream: the family's Hugging Face names,
   the MTP depths in the engine's layout, what vLLM's load_weights takes), then each rank, one
   rollout engine, takes its share of the step's prompts and samples a group of G responses per
   prompt by speculative decoding (megatron_mtp.serving.speculative, the decoder of
   tools/eval_speculative.py, over its KV cache), the MTP depths drafting and the main head
   verifying. Tokens are sampled by
   per-position Gumbel noise keyed by (seed, response, position), so the rollouts are exactly
   plain sampling's, with or without drafts. The responses are gathered, and each data-parallel
   replica trains on its share;
2. rewards from the task (examples/rl/task.py: string reversal, exact), group-normalized
   advantages A = (r - mean_group) / (std_group + 1e-6) given to every token of the response;
3. one exact optimizer step on a SplitStep: the main loss is the policy gradient's, sum of
   A_t * (-log pi(a_t)) through step_loss.main_loss, at token level (divided by the step's
   response tokens) or sequence level (each response's token mean, averaged over responses:
   GRPO's; on packed rows the step is token level and each response's tokens carry
   A / n_i x N_tok / N_seq, the same loss); one update per batch of rollouts, so the importance
   ratio is 1 and its clipping does nothing (no KL term). The MTP heads train on the rollout
   tokens with mtp_detach_heads: their loss never reaches the policy.

--engine vllm (--policy mimo: Qwen2 with MiMo's MTP depths, one repeated layer, heads of 32: what vLLM's
CPU build drafts for here): the rollouts come from vLLM's CPU build (`tools/bootstrap --engine vllm`,
the project's patches applied), in processes of their own on rank 0, kept for the run and updated in
place by the weight stream before every step's rollouts (serving.stream.update_engine, batches of
--weight-bucket-mb; the drafter's weights in an update of their own). --rollouts speculative (the
default): one engine samples every rollout at temperature 1, each response with a seed of its own, by
speculative decoding, the heads drafting and vLLM's rejection sampler verifying (--draft-sample-method:
greedy, vLLM's default, or probabilistic); each step prints the engine's own acceptance per depth from
its counters for that step's rollouts (mtp_k vllm acceptance, vllm mean acceptance length) and the
rollout time, and --out keeps every step's engine tokens (engine_tokens.jsonl). The rollouts depend on
the drafts, so online, frozen and no heads take trajectories of their own. --rollouts plain (the
coupled comparison): one engine samples every rollout by plain decoding at temperature 1, a seed per
response, so the rollouts depend on the policy's weights alone; the other drafts with the heads,
greedily, and each step prints its acceptance per depth (mtp_k vllm greedy acceptance) beside the
project's decoder's on the same prompts with vLLM's draft chain (mtp_k decoder greedy acceptance). In
both, the decoder's engine view below is printed too.

--heads online: the heads train every step (above); frozen: they keep the weights they had
after the warm-start (restored after every step), so their drafts age as the policy moves;
none: no MTP depths (plain sampling). With --engine decoder and --rollouts plain the policy's
trajectory is the same in all three: the same rewards every step and the same backbone weights at
the end (summary.json's "backbone sha256"), because detached heads draw from random streams of
their own, never reach the backbone's gradients, and the rollouts do not depend on the drafts.

Before RL, --sft-steps supervised steps on correct answers (the same SplitStep, advantage 1)
give the policy a start that RL improves on, and its heads something to draft with.

--mtp-loss-type: what online heads train toward (spec section 12): the rollout tokens (ce) or the
policy's own distribution at the rollouts' temperature 1 (kl, tv, e2e_tv); with
--mtp-positive-advantage only on responses whose advantage is > 0 (the MTP-only sample mask).

Each RL step prints one line in the trainer's console format (rank 0; tools/plot_runs.py reads
it): reward, rollout acceptance per depth (vLLM's per-position rate of the Gumbel-coupled
rollouts) and mean acceptance length (incl. bonus); the engine's view, in both of vLLM's draft
modes: the same per-position rate and mean length of one rejection-sampling decode of each prompt
with drafts from q, accepted with min(1, p / q) (vLLM's opt-in draft_sample_method
"probabilistic": mtp_k engine acceptance), and of one with greedy drafts argmax q, accepted with
p(argmax q) (vLLM's default "greedy": mtp_k engine acceptance (greedy drafts)); their tokens are
discarded, so the rollouts stay the same; the heads' teacher-forced acceptance on the rollouts
(mtp_k acceptance, top-1), sampled acceptance (mtp_k sampled acceptance: the mean of
sum_v min(p, q)) and greedy-draft acceptance (mtp_k greedy-draft acceptance: the mean of
p(argmax q)); the policy-gradient loss, grad norms. --out DIR keeps that log (console.log) and summary.json.
Progress goes to stderr.
"""

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from datetime import datetime
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

if __package__:  # imported as examples.rl.grpo (python -m benchmarks.rl_rollout_bench, from the checkout)
    from .task import EOS, Reversal
else:  # run as a script (torchrun examples/rl/grpo.py): its directory is first on sys.path
    from task import EOS, Reversal

PROG = "grpo.py"
# The engine's metric names by vLLM draft_sample_method: the probabilistic mode's keep their first names
ENGINE_NAMES = {"probabilistic": "", "greedy": " (greedy drafts)"}


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


def policy_config(args, task, depths: int) -> dict:
    """The policy's shape as its Hugging Face config.json says it (the weight stream's family and names)."""
    shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers, "num_attention_heads": 4,
             "vocab_size": task.vocab_size, "max_position_embeddings": task.sequence_length,
             "num_nextn_predict_layers": depths}
    if args.policy == "llama":
        return {**shape, "architectures": ["LlamaForCausalLM"], "intermediate_size": 4 * args.hidden_size,
                "rms_norm_eps": 1e-5}
    if args.policy == "mimo":
        # Qwen2 with MTP (q/k/v biases): two heads, so heads of 32 at hidden 64 (vLLM's CPU attention's
        # smallest); positions for twice a rollout (vLLM counts the prompt and every response token,
        # the last included, against the model's length)
        return {**shape, "architectures": ["MiMoForCausalLM"], "num_attention_heads": 2, "num_key_value_heads": 1,
                "intermediate_size": 4 * args.hidden_size, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 2 * task.sequence_length}
    # Qwen3.5-MoE, tiny: every fourth layer gated full attention (q/k norms, a quarter of each head
    # rotated), the others Gated DeltaNet with 2 key heads (a multiple of CP = 2: whole heads per rank
    # after its all-to-all); experts and a gated shared expert in every layer and MTP depth.
    return {**shape, "architectures": ["Qwen3_5MoeForCausalLM"], "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
            "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
            "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": args.hidden_size // 2,
            "shared_expert_intermediate_size": args.hidden_size // 2}


def build(args, task):
    """The policy (DDP-wrapped chunks, its optimizer, its MTP depths, the arguments a checkpoint of it
    would hold) and the rollout engine's model, whose weights stream in the family's Hugging Face
    names."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megatron_mtp.library.initialize import initialize_distributed
    from megatron_mtp.library.model import build_model
    from megatron_mtp.serving import model as serving_model
    from megatron_mtp.serving.config import ModelConfig

    initialize_distributed(1, 1, None, args.seed, cp=args.context_parallel_size)
    depths = 0 if args.heads == "none" else args.depths
    shape = ModelConfig.from_hf(policy_config(args, task, depths), pad_to=1)
    # Qwen3.5's MTP block is one layer, which vLLM and SGLang run at every drafted position (its
    # layout streams one), and vLLM runs MiMo's first MTP layer at every drafted position: D depths
    # of one repeated layer
    shape.mtp_repeated = args.policy in ("qwen3_5", "mimo")
    policy_args = shape.megatron_args()
    # The serving config (one process) made the trainer's: CP, and Qwen3.5's auxiliary loss, which the
    # engine does not compute (an import's arguments hold none)
    router = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 1e-3} if policy_args.num_experts \
        else {}
    config = dataclasses.replace(serving_model.transformer_config(policy_args), calculate_per_token_loss=True,
                                 mtp_detach_heads=bool(depths), mtp_loss_scaling_factor=0.3,
                                 mtp_loss_type=args.mtp_loss_type, context_parallel_size=args.context_parallel_size,
                                 **router)
    chunks = build_model(config, task.vocab_size, task.sequence_length)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=args.lr, weight_decay=0.0,
                                                       clip_grad=1.0),
                                       chunks)  # fp32, not distributed: see --heads frozen
    # The rollout engine's own model (one process, its KV cache), given the policy's weights by the stream
    rollout_model = serving_model.build(policy_args, pg_collection=serving_model.own_groups())
    return chunks, optimizer, depths, policy_args, rollout_model


def refresh(rollout_model, chunks, policy_args) -> bool:
    """The policy's weights into the rollout engine, as an RL framework pushes them after every step: the
    weight stream's (name, tensor) in Hugging Face names (what vLLM's load_weights and SGLang's
    update_weights_from_tensor take; docs/serving.md), loaded here by the import's mapping. A collective:
    every rank streams. Returns whether the engine holds what it was sent, bit for bit: its weights in
    the stream's names equal the stream's. (Its own tensors may differ from the policy's in the last
    bit where the family stores a norm as 1 + w: Qwen3.5's Gated DeltaNet output norm; see
    `largest_difference`.)"""
    from megatron_mtp.serving import export, mapping, stream
    from megatron_mtp.serving.config import ModelConfig

    # the decoder drafts with every trained depth, whatever the family: its own layout (an export
    # leaves out the depths of a family no engine drafts for)
    layout = mapping.default_mtp_layout(ModelConfig.from_megatron_args(policy_args)) if policy_args.mtp_num_layers \
        else "none"
    plan = export.plan(policy_args, layout)
    hf = dict(stream.weights(chunks, policy_args, mtp_layout=layout))
    depths = plan.cfg.mtp_num_layers if plan.layout else 0
    own = mapping.hf_to_megatron(hf, plan.cfg, plan.layout, depths)
    if plan.cfg.mtp_repeated:  # the one layer the engine runs at every depth, as the import holds it
        own = mapping.collapse_repeated(own, depths)
    missing, unexpected = rollout_model.load_state_dict(own, strict=False)
    left = [name for name in missing if "_extra_state" not in name]
    if unexpected or left:
        raise RuntimeError(f"the stream does not fill the engine's model: {(unexpected + left)[:3]}")
    held = export.hf_tensors(plan, dict(rollout_model.named_parameters()), "the rollout engine")
    return sorted(held) == sorted(hf) and all(torch.equal(held[name], hf[name]) for name in hf)


def largest_difference(rollout_model, model) -> float:
    """The largest |engine - policy| over the policy's parameters (the same names in both): 0 where
    the stream is lossless, at most 2^-24 for a norm streamed as 1 + w (w' + 1 - 1 in fp32)."""
    engine, policy = dict(rollout_model.named_parameters()), dict(model.named_parameters())
    if sorted(engine) != sorted(policy):
        raise RuntimeError(f"the engine's parameters are not the policy's: {sorted(set(engine) ^ set(policy))[:3]}")
    return max(float((engine[name].detach() - value.detach()).abs().max()) for name, value in policy.items())


def policy_gradient_loss(per_token_ce, advantages, loss_mask):
    """A_t * (-log pi(a_t)) per token, normalized by the running step (token or sequence level)."""
    from megatron.core.fork.mtp.step_loss import main_loss

    return main_loss(per_token_ce * advantages, loss_mask)


def forward_step(data_iterator, model, positive_advantage_only=False):
    """Micro-batch = (tokens [b, s+1], loss_mask [b, s], advantages [b, s]). With
    positive_advantage_only the MTP depths see only the responses whose advantage is > 0. Under CP
    the advantages are cut as gpt_per_token_loss cuts the loss mask."""
    from megatron.core import parallel_state

    from megatron.core.fork.runtime import context_parallel
    from megatron_mtp.library.step import gpt_per_token_loss

    tokens, loss_mask, advantages = next(data_iterator)
    sample_mask = (advantages.sum(dim=1) > 0).float() if positive_advantage_only else None
    output, loss_mask = gpt_per_token_loss(model, tokens, loss_mask, sample_mask)
    advantages = advantages.to(loss_mask.device)
    if parallel_state.get_context_parallel_world_size() > 1:
        advantages = context_parallel.shard(advantages, 1, parallel_state.get_context_parallel_group())
    return output, partial(policy_gradient_loss, advantages=advantages, loss_mask=loss_mask)


def packed_forward_step(data_iterator, model, positive_advantage_only=False):
    """Micro-batch = one packed row (`packed_rows`); under CP this rank's pieces of its sequences
    (cut by the padded cu_seqlens), the MTP depths rolled within each sequence."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron.core.fork.runtime import context_parallel
    from megatron.core.fork.runtime import device as compute_device

    input_ids, loss_mask, weights, labels, positions, padded, unpadded = next(data_iterator)
    device = compute_device.current_device()
    model_mask = loss_mask * (weights > 0) if positive_advantage_only else loss_mask
    if positive_advantage_only and model.config.sparse_lm_loss:
        raise ValueError("an MTP-only sample mask needs the main head's dense loss: turn sparse_lm_loss off")
    row = [t.to(device) for t in (input_ids, labels, loss_mask, model_mask, weights, positions)]
    padded, unpadded = padded.to(device), unpadded.to(device)
    if parallel_state.get_context_parallel_world_size() > 1:
        group = parallel_state.get_context_parallel_group()
        row = [context_parallel.shard(t, 1, group, padded) for t in row]
    input_ids, labels, loss_mask, model_mask, weights, positions = row
    longest = int((padded[1:] - padded[:-1]).max())
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=unpadded, cu_seqlens_kv=unpadded,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    output = model(input_ids, positions, None, labels=labels, loss_mask=model_mask, packed_seq_params=packed)
    return output, partial(policy_gradient_loss, advantages=weights, loss_mask=loss_mask)


def packed_rows(sequences, advantages, task, args) -> list:
    """THD rows of --micro-batch-size sequences each, as RL frameworks pack: every sequence its own
    segment (its tokens the inputs, each target the next token of the same sequence, the last none),
    padded to a multiple of 2 x CP (context parallelism's split; the padding masked), the row's
    last segment padded to the row's fixed length. Per row: (input ids, loss mask, per-token
    advantages, labels, positions from 0 in every sequence [1, T]; padded and real cu_seqlens)."""
    step = 2 * args.context_parallel_size
    length = args.micro_batch_size * -(-task.sequence_length // step) * step
    rows = []
    for first in range(0, len(sequences), args.micro_batch_size):
        input_ids, labels, positions = (torch.zeros(1, length, dtype=torch.long) for _ in range(3))
        loss_mask, weights = torch.zeros(1, length), torch.zeros(1, length)
        padded, real = [0], [0]
        chunk = slice(first, first + args.micro_batch_size)
        for sequence, advantage in zip(sequences[chunk], advantages[chunk], strict=True):
            start, n = padded[-1], len(sequence)
            end = start + -(-n // step) * step
            input_ids[0, start:start + n] = torch.tensor(sequence)
            labels[0, start:start + n - 1] = torch.tensor(sequence[1:])
            loss_mask[0, start + task.prompt_length - 1:start + n - 1] = 1.0  # the positions predicting the response
            weights[0, start:end] = advantage
            positions[0, start:end] = torch.arange(end - start)
            padded.append(end)
            real.append(real[-1] + n)
        padded[-1] = length
        rows.append((input_ids, loss_mask, weights * loss_mask, labels, positions,
                     torch.tensor(padded, dtype=torch.int32), torch.tensor(real, dtype=torch.int32)))
    return rows


def train_step(chunks, optimizer, sequences, advantages, task, args) -> dict:
    """One exact step over this replica's sequences (prompt + response, responses of any length up to
    the answer's) and per-sequence advantages: one per row (padded), or packed."""
    from megatron.core import parallel_state

    from megatron_mtp.library import step

    if len(sequences) != len(advantages):
        raise ValueError(f"{len(sequences)} sequences, {len(advantages)} advantages")
    if args.rows == "packed":
        level = args.main_loss_level
        if level == "sequence":
            # The step counts a packed row as one sequence; GRPO's mean over responses of each one's token
            # mean is the token-level loss with response i's tokens weighted A_i / n_i x N_tok / N_seq.
            lengths = [len(s) - task.prompt_length for s in sequences]  # its predicted tokens
            tokens, responses = all_sum([sum(lengths), len(lengths)], parallel_state.get_data_parallel_group())
            advantages = [a / n * tokens / responses for a, n in zip(advantages, lengths, strict=True)]
            level = "token"
        rows = packed_rows(sequences, advantages, task, args)
        return step.train_step(chunks, optimizer, rows, rows[0][0].size(1), level,
                               forward_step=partial(packed_forward_step,
                                                    positive_advantage_only=args.mtp_positive_advantage))
    tokens = torch.zeros(len(sequences), task.sequence_length, dtype=torch.long)
    loss_mask = torch.zeros(len(sequences), task.sequence_length - 1)
    for row, sequence in enumerate(sequences):
        tokens[row, :len(sequence)] = torch.tensor(sequence)
        loss_mask[row, task.prompt_length - 1:len(sequence) - 1] = 1.0  # the positions predicting the response
    per_token = torch.tensor(advantages, dtype=torch.float32).unsqueeze(1) * loss_mask
    size = args.micro_batch_size
    microbatches = [(tokens[i:i + size], loss_mask[i:i + size], per_token[i:i + size])
                    for i in range(0, tokens.size(0), size)]
    return step.train_step(chunks, optimizer, microbatches, tokens.size(1) - 1, args.main_loss_level,
                           forward_step=partial(forward_step, positive_advantage_only=args.mtp_positive_advantage))


def rollouts(runner, prompts, task, args, step: int, first_index: int, stats):
    """G sampled responses per prompt, drafted by the MTP depths (none: plain sampling)."""
    from megatron_mtp.serving import speculative

    responses = []
    for p, prompt in enumerate(prompts):
        for g in range(args.group_size):
            key = (step * args.prompts_per_step + first_index + p) * args.group_size + g  # unique per response
            # temperature 1: the policy gradient's log pi is the model's own softmax (ratio 1)
            choose = speculative.GumbelSampler(args.seed, key)
            responses.append(speculative.speculative(runner, prompt, task.answer_length, stats, choose=choose,
                                                     stop=EOS))
    return responses


def engine_decodes(runner, prompts, task, args, step: int, first_index: int, stats: dict) -> None:
    """What a serving engine would see of the heads: one rejection-sampling decode of each prompt in
    each of vLLM's draft modes (``stats``: a speculative.Stats per speculative.DRAFT_SAMPLE_METHODS
    name; probabilistic: drafts from q, accepted with min(1, p / q); greedy: drafts argmax q,
    accepted with p(argmax q)), vLLM's counting, at the rollouts' temperature 1. Their tokens are
    discarded, so the rollouts and the policy's trajectory stay the same whatever the heads are;
    their randomness is a stream of their own (keys after every rollout's, one range per mode)."""
    from megatron_mtp.serving import speculative

    offset = (args.steps + 1) * args.prompts_per_step * args.group_size  # beyond every rollout's key
    for mode, method in enumerate(speculative.DRAFT_SAMPLE_METHODS):
        first_key = offset + mode * (args.steps + 1) * args.prompts_per_step
        for p, prompt in enumerate(prompts):
            key = first_key + step * args.prompts_per_step + first_index + p
            sampler = speculative.RejectionSampler(args.seed, key, draft_sample_method=method)
            speculative.speculative(runner, prompt, task.answer_length, stats[method], choose=sampler, stop=EOS)


class VllmRollouts:
    """vLLM's CPU build as the rollout engine (--engine vllm), on rank 0, as RL frameworks keep one alive
    for a run. --rollouts speculative: one engine samples the rollouts at temperature 1, each response
    with a seed of its own, the heads drafting and vLLM's rejection sampler verifying
    (--draft-sample-method), and counts what it accepted. --rollouts plain: one engine samples them by
    plain decoding (so the rollouts depend on the policy's weights alone: online, frozen and no heads
    keep one trajectory) and one drafts with the heads, greedily, for its acceptance alone. The engines
    start on an export of the policy after the warm start; before every step's rollouts the weight
    stream pushes the policy's weights into each in place (serving.stream: the target's, and the
    drafter's into an engine that drafts). Every rank calls every method (the stream is a collective);
    rank 0 alone drives the engines."""

    def __init__(self, chunks, policy_args, depths: int, args, out: Path | None):
        import tempfile

        from megatron_mtp.serving import export, files, stream
        from megatron_mtp.serving.engines import vllm_engine

        self.chunks, self.policy_args, self.depths = chunks, policy_args, depths
        self.bucket_bytes = int(args.weight_bucket_mb * 2**20)
        self.speculative = args.rollouts == "speculative"
        # whether each engine drafts (the rollouts' engine first); the engines themselves on rank 0 alone
        self.drafts = [bool(depths)] if self.speculative else [False] + [True] * bool(depths)
        self.engines = [None] * len(self.drafts)
        self.engine_seed = None
        self.tokens = None  # where the speculative rollouts' tokens and steps go, one line per step
        hf = dict(stream.weights(chunks, policy_args))  # a collective
        if dist.get_rank() != 0:
            return
        plan = export.plan(policy_args)
        self.directory = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        files.write_hf(Path(self.directory.name), plan.cfg.to_hf("fp32", plan.layout), hf, "fp32", None)
        log = open(out / "engine.log", "w") if out is not None else None
        # vLLM's own generator (what a request without a seed draws from) seeded anew every run: a run
        # repeats through its responses' seeds alone, as it must where an RL framework's batches vary
        self.engine_seed = int.from_bytes(os.urandom(4), "little")
        speculative = {"method": "mtp", "num_speculative_tokens": depths}
        if self.speculative:
            speculative["draft_sample_method"] = args.draft_sample_method
        for index, drafts in enumerate(self.drafts):
            options = {"speculative_config": speculative} if drafts else {}
            self.engines[index] = vllm_engine.Engine(self.directory.name, log=log, seed=self.engine_seed, **options)
        if self.speculative and depths and out is not None:
            self.tokens = open(out / "engine_tokens.jsonl", "w")

    def push(self) -> int:
        """The policy's weights into every engine, in place (a collective); the bytes sent."""
        from megatron_mtp.serving import stream

        return sum(stream.update_engine(engine, self.chunks, self.policy_args, self.bucket_bytes, drafts=drafts)
                   for engine, drafts in zip(self.engines, self.drafts, strict=True))

    def sample(self, prompts: list, task, args, step: int) -> tuple[list, list]:
        """G responses per prompt at temperature 1, response r's seed its key (as the decoder's rollouts
        key their Gumbel noise), on every rank; and where the heads drafted them, what the engine
        counted of this request: [verify steps, accepted per position...] (rank 0's; zeros elsewhere, so
        that a sum over ranks is the engine's). With --out, each step's prompts, seeds, responses, sampling
        steps and counters are a line of engine_tokens.jsonl (tools/eval_speculative.py --engine-tokens'
        fields)."""
        responses, counts = None, [0] * (1 + self.depths)
        if dist.get_rank() == 0:
            requests = [prompt for prompt in prompts for _ in range(args.group_size)]
            seeds = [args.seed * 10**9 + step * args.prompts_per_step * args.group_size + r
                     for r in range(len(requests))]
            drafted = self.drafts[0]
            reply = self.engines[0].generate(requests, task.answer_length, temperature=1.0, seeds=seeds,
                                             stop_token_ids=[EOS], steps=drafted)
            responses = reply["outputs"]
            if drafted:
                counted = reply["spec_decode"]
                counts = [counted["drafts"], *counted["accepted per position"]]
            if self.tokens is not None:
                self.tokens.write(json.dumps({
                    "iteration": step, "prompts": requests, "seeds": seeds, "outputs": responses,
                    "steps": reply["steps"], "temperature": 1.0, "draft_sample_method": args.draft_sample_method,
                    "spec_decode": reply["spec_decode"]}) + "\n")
                self.tokens.flush()
        shared = [responses]
        dist.broadcast_object_list(shared, src=0)
        return shared[0], counts

    def acceptance(self, prompts: list, task) -> list:
        """--rollouts plain: vLLM's greedy speculative decode of every prompt in the drafting engine:
        [verify steps, accepted per position...] (rank 0's counters; zeros elsewhere)."""
        if dist.get_rank() != 0 or not self.depths:
            return [0] * (1 + self.depths)
        counted = self.engines[1].generate(prompts, task.answer_length, stop_token_ids=[EOS])["spec_decode"]
        return [counted["drafts"], *counted["accepted per position"]]

    def rollout_engine(self) -> dict:
        """The rollouts' engine (rank 0): the speculative decoding it runs, as vLLM's config holds it, and
        the seed of its own generator."""
        return {"speculative config": self.engines[0].speculative if self.engines[0] is not None else None,
                "seed": self.engine_seed}

    def close(self) -> None:
        for engine in self.engines:
            if engine is not None:
                engine.close()
        if self.tokens is not None:
            self.tokens.close()


def decoder_greedy_acceptance(runner, prompts: list, task, depths: int) -> list:
    """The project's decoder on the same prompts as vLLM's drafting engine: greedy, drafts chained as vLLM
    chains them (speculative.VllmDrafter): [verify steps, accepted per position...]."""
    from megatron_mtp.serving import speculative

    stats = speculative.Stats(depths=depths)
    for prompt in prompts:
        speculative.speculative(runner, prompt, task.answer_length, stats, chain="vllm", stop=EOS)
    return [stats.drafts, *stats.accepted_per_position]


def acceptance_values(values: dict, counts: list, per_depth: str, length: str) -> None:
    """counts = [verify steps, accepted per position...] (vLLM's counting) -> each depth's per-position
    rate (`per_depth` with its {k}) and the mean acceptance length with the bonus token (`length`)."""
    drafts, accepted = counts[0], counts[1:]
    for k, count in enumerate(accepted, 1):
        values[per_depth.format(k=k)] = count / max(drafts, 1)
    values[length] = 1 + sum(accepted) / max(drafts, 1)


def advantages_of(rewards: list[float], group: int) -> list[float]:
    out = []
    for i in range(0, len(rewards), group):
        r = rewards[i:i + group]
        mean, std = statistics.fmean(r), statistics.pstdev(r)
        out += [(x - mean) / (std + 1e-6) for x in r]
    return out


def replica_share(sequences: list, advantages: list, dp: int, dp_rank: int) -> tuple[list, list]:
    """Every engine's sequences and advantages (rank order: the step's prompt order), then this
    data-parallel replica's share (a replica's CP ranks train the same sequences)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sequences, advantages))
    sequences = [s for mine, _ in gathered for s in mine]
    advantages = [a for _, mine in gathered for a in mine]
    share = len(sequences) // dp
    return sequences[dp_rank * share:(dp_rank + 1) * share], advantages[dp_rank * share:(dp_rank + 1) * share]


def all_sum(values: list[float], group=None) -> list[float]:
    """Summed over the world's ranks (or `group`'s)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def digest(model, heads: bool) -> str | None:
    """sha256 of the backbone's parameters (heads=False) or the MTP block's, in name order; None if none."""
    found, hasher = False, hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if name.startswith("mtp.") == heads:
            found = True
            hasher.update(name.encode())
            hasher.update(param.detach().float().contiguous().numpy().tobytes())
    return hasher.hexdigest() if found else None


def console_line(step: int, steps: int, values: dict) -> str:
    text = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}] iteration {step:8d}/{steps:8d} |"
    return text + "".join(f" {name}: {value:.6g} |" for name, value in values.items())


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    torch.set_num_threads(1)
    task = Reversal(args.length, args.alphabet)
    chunks, optimizer, depths, policy_args, rollout_model = build(args, task)
    from megatron.core import parallel_state

    from megatron_mtp.serving import speculative
    from megatron_mtp.serving.model import Runner

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    engines = dist.get_world_size()  # every rank runs a rollout engine
    if args.prompts_per_step % engines:
        raise SystemExit(f"{PROG}: error: --prompts-per-step {args.prompts_per_step} must split into {engines} "
                         "rollout engines (one per rank)")
    model = chunks[0].module
    runner = Runner(rollout_model, task.vocab_size)
    share = args.prompts_per_step // engines
    mine = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    out = Path(args.out) if args.out else None
    log = None
    if out is not None and dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "console.log", "w")
        # upstream's argument dump format: tools/plot_runs.py counts tokens with it
        log.write(f"  seq_length ........ {task.sequence_length - 1}\n")

    def emit(line: str) -> None:
        if dist.get_rank() == 0:
            print(line, flush=True)
            if log:
                log.write(line + "\n")
                log.flush()

    # Warm start: supervised steps on correct answers (advantage 1: the policy-gradient loss is the CE).
    for step in range(args.sft_steps):
        prompts = task.prompts(args.prompts_per_step * args.group_size, args.seed + 1, step)
        share = len(prompts) // dp
        batch = [p + task.answer(p) for p in prompts[dp_rank * share:(dp_rank + 1) * share]]
        metrics = train_step(chunks, optimizer, batch, [1.0] * len(batch), task, args)
        if (step + 1) % 10 == 0 or step + 1 == args.sft_steps:
            progress(f"warm-start step {step + 1}/{args.sft_steps}: lm loss {metrics['lm loss']:.4f}")
    frozen = {name: param.detach().clone() for name, param in model.named_parameters() if name.startswith("mtp.")}
    heads_after_warm_start = digest(model, heads=True)

    vllm = VllmRollouts(chunks, policy_args, depths, args, out) if args.engine == "vllm" else None
    try:  # the engines' processes end with the run, however it ends
        rewards_per_step, synced, differences, pushed, started = [], [], [], [], time.perf_counter()
        for step in range(1, args.steps + 1):
            every_prompt = task.prompts(args.prompts_per_step, args.seed, step)
            prompts = every_prompt[mine]
            synced.append(refresh(rollout_model, chunks, policy_args))  # the rollouts sample the policy as it is now
            differences.append(largest_difference(rollout_model, model))
            stats = speculative.Stats(depths=depths)
            if vllm is not None:
                pushed.append(vllm.push())  # the engines sample and draft with the policy as it is now
            rollout_start = time.perf_counter()
            if vllm is None:
                responses = rollouts(runner, prompts, task, args, step, mine.start, stats)
                rollout_counts = [stats.drafts, *stats.accepted_per_position]
            else:  # the engine's counts of its speculative rollouts (none drafted with --rollouts plain)
                responses, rollout_counts = vllm.sample(every_prompt, task, args, step)
                responses = responses[mine.start * args.group_size:mine.stop * args.group_size]
            rollout_seconds = time.perf_counter() - rollout_start
            if vllm is not None and dist.get_rank() != 0:
                rollout_seconds = 0.0  # it waited for rank 0's engine, which sampled every rollout
            engines_by_mode = {method: speculative.Stats(depths=depths) for method in speculative.DRAFT_SAMPLE_METHODS}
            if depths:
                engine_decodes(runner, prompts, task, args, step, mine.start, engines_by_mode)
            engine_counts = [count for mode in (engines_by_mode[m] for m in speculative.DRAFT_SAMPLE_METHODS)
                             for count in (mode.drafts, *mode.accepted_per_position)]
            expanded = [p for p in prompts for _ in range(args.group_size)]
            if len(expanded) != len(responses):
                raise RuntimeError(f"{len(responses)} responses for {len(expanded)} prompt samples")
            rewards = [task.reward(p, r) for p, r in zip(expanded, responses)]
            sequences, advantages = replica_share([p + r for p, r in zip(expanded, responses)],
                                                  advantages_of(rewards, args.group_size), dp, dp_rank)
            metrics = train_step(chunks, optimizer, sequences, advantages, task, args)
            if args.heads == "frozen":
                # The optimizer steps these fp32 parameters themselves (no distributed optimizer, no
                # bf16 main copies), so restoring them here is what the next step starts from.
                with torch.no_grad():
                    for name, param in model.named_parameters():
                        if name in frozen:
                            param.copy_(frozen[name])
            greedy = []  # vLLM's greedy speculative decode beside the decoder's with vLLM's chain
            if args.rollouts == "plain" and depths:
                greedy = vllm.acceptance(every_prompt, task) + decoder_greedy_acceptance(runner, prompts, task, depths)
            totals = all_sum([sum(rewards), len(rewards), sum(r == 1.0 for r in rewards), *rollout_counts,
                              *engine_counts, *greedy, rollout_seconds])
            reward, solved = totals[0] / totals[1], totals[2] / totals[1]
            rewards_per_step.append(reward)
            values = {"consumed samples": step * args.prompts_per_step * args.group_size, "reward": reward,
                      "solved": solved}
            # [verify steps, accepted per position...] blocks: the rollouts', each draft mode's engine decode,
            # then (--rollouts plain) vLLM's greedy decode and the decoder's beside it
            span, counted = 1 + depths, totals[3:-1]
            blocks = [counted[i:i + span] for i in range(0, len(counted), span)]
            if depths and vllm is None:
                acceptance_values(values, blocks[0], "mtp_{k} rollout acceptance",
                                  "rollout mean acceptance length (incl. bonus)")
            if depths and args.rollouts == "speculative":  # as vLLM counted its rollouts
                acceptance_values(values, blocks[0], "mtp_{k} vllm acceptance",
                                  "vllm mean acceptance length (incl. bonus)")
            if depths:
                for method, block in zip(speculative.DRAFT_SAMPLE_METHODS, blocks[1:3], strict=True):
                    named = ENGINE_NAMES[method]
                    acceptance_values(values, block, "mtp_{k} engine acceptance" + named,
                                      "engine mean acceptance length (incl. bonus)" + named)
            if greedy:
                for side, block in zip(("vllm", "decoder"), blocks[3:], strict=True):
                    acceptance_values(values, block, f"mtp_{{k}} {side} greedy acceptance",
                                      f"{side} greedy mean acceptance length (incl. bonus)")
            values["policy-gradient loss"] = metrics["lm loss"]  # the step's main loss
            for k in range(1, depths + 1):
                values[f"mtp_{k} loss"] = metrics[f"mtp_{k} loss"]
                values[f"mtp_{k} acceptance"] = metrics[f"mtp_{k} acceptance"]
                values[f"mtp_{k} sampled acceptance"] = metrics[f"mtp_{k} sampled acceptance"]
                values[f"mtp_{k} greedy-draft acceptance"] = metrics[f"mtp_{k} greedy-draft acceptance"]
                if f"mtp_{k} load balancing loss" in metrics:  # the depth's aux_loss (the qwen3_5 policy's experts)
                    values[f"mtp_{k} load balancing loss"] = metrics[f"mtp_{k} load balancing loss"]
            values["grad norm"] = metrics["grad norm"]
            if "mtp grad norm" in metrics:  # the MTP group's own norm (detached heads)
                values["mtp grad norm"] = metrics["mtp grad norm"]
            if vllm is None:
                values["rollout seconds per rank"] = totals[-1] / engines
            else:  # rank 0's engine sampled every rollout
                values["rollout seconds"] = totals[-1]
            emit(console_line(step, args.steps, values))
            elapsed = time.perf_counter() - started
            progress(f"RL step {step}/{args.steps}: reward {reward:.4f}, ETA "
                     f"{time.strftime('%H:%M:%S', time.gmtime(elapsed / step * (args.steps - step)))}")

    finally:
        if vllm is not None:
            vllm.close()

    summary = {"heads": args.heads, "depths": depths, "mtp loss type": args.mtp_loss_type, "rewards": rewards_per_step,
               "backbone sha256": digest(model, heads=False), "heads sha256 after warm start": heads_after_warm_start,
               "heads sha256": digest(model, heads=True),
               # per RL step: whether the rollout model held the streamed weights bit for bit after the push
               "rollout model synced": synced, "rollout model largest difference from the policy": differences,
               "arguments": vars(args)}
    if vllm is not None:  # per RL step: the bytes the weight stream pushed into vLLM's engines (rank 0)
        summary["bytes pushed into vllm"] = pushed
        summary["vllm rollout engine"] = vllm.rollout_engine()
    if dist.get_rank() == 0 and out is not None:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        log.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
