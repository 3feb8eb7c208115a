# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""This script's defaults: on a machine without CUDA what runs there (local layers, no fused CUDA
kernels, CPU initialization, gloo); on GPUs Megatron-LM's, except what needs a package that is not
installed (Transformer Engine, apex: docs/gpus.md); with no data flag the embedded default, a tiny
GPT with 2 MTP depths on the embedded corpus (megatron_mtp.data.embedded), saving to runs/default.
Also the flags this script adds to Megatron-LM's (`provider`).
"""

import argparse
import os
import sys

from megatron_mtp.arguments import gpus
from megatron_mtp.data.embedded import corpus_path, default_cache_dir

DATA_FLAGS = ("--data-path", "--mock-data", "--train-data-path", "--valid-data-path", "--test-data-path",
              "--data-args-path", "--per-split-data-args-path")
EMBEDDED_DEFAULTS = dict(
    num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
    micro_batch_size=8, global_batch_size=16, train_iters=300, lr=3e-3, min_lr=3e-4,
    lr_decay_style="cosine", lr_warmup_iters=20, weight_decay=0.01, clip_grad=1.0,
    mtp_num_layers=2, mtp_loss_scaling_factor=0.3, eval_interval=100, eval_iters=4, log_interval=10,
    save="runs/default", save_interval=100, split="98,2,0",
    exit_signal_handler=True,  # SIGTERM (a preempted job, kill) saves before the run exits
)
CPU_DEFAULTS = dict(
    transformer_impl="local", use_cpu_initialization=True, apply_rope_fusion=False,
    bias_dropout_fusion=False, bias_gelu_fusion=False, masked_softmax_fusion=False,
    no_persist_layer_norm=True, gradient_accumulation_fusion=False, distributed_backend="gloo",
)


def provider(defaults: dict):
    def add(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("Megatron-MTP")
        group.add_argument("--main-loss-level", choices=["token", "sequence"], default="token",
                           help="main loss: mean over the step's valid tokens, or mean over its valid "
                                "sequences of each sequence's token mean (MTP is always normalized by the "
                                "token count)")
        group.add_argument("--freeze-backbone", action="store_true",
                           help="train the MTP heads only (draft heads beside a backbone another objective "
                                "owns): every parameter outside the MTP block is frozen, and every MoE router's expert "
                                "bias there; needs --mtp-detach-heads. The main loss is still computed and logged.")
        group.add_argument("--create-attention-mask-in-dataloader", action="store_true",
                           help="build the dataset's causal attention mask every micro-batch (Megatron-LM's "
                                "default; off here: the attention is causal without it, SDPA or Transformer "
                                "Engine, and the model does not read it)")
        group.add_argument("--log-file", default=None,
                           help="append the console output of the rank that prints the iteration lines (the "
                                "last) to this file; the embedded default writes SAVE/train.log")
        group.add_argument("--dry-run", action="store_true",
                           help="check the arguments, the data and the checkpoint to load, print the "
                                "layout, and exit without building anything")
        parser.set_defaults(**defaults)
        return parser
    return add


def given(flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in sys.argv[1:])


def initial(on_cpu: bool, embedded: bool) -> dict:
    # Megatron-LM 0.19's loop needs an evaluation interval even without evaluation; 1000 was
    # its default before the flag lost it.
    # The model's attention is causal without a mask (SDPA, Transformer Engine) and forward_step
    # passes none: the dataloader does not build one per micro-batch (benchmarks/README.md).
    defaults = dict(calculate_per_token_loss=True, position_embedding_type="rope", eval_interval=1000,
                    create_attention_mask_in_dataloader=False)
    defaults.update(CPU_DEFAULTS if on_cpu else gpu_defaults())
    if embedded:
        # the corpus is written once the arguments are accepted (arguments.parse): a refused run writes nothing
        defaults.update(EMBEDDED_DEFAULTS, data_path=[str(corpus_path(default_cache_dir()))])
    return defaults


def gpu_defaults() -> dict:
    """Megatron-LM's GPU defaults assume Transformer Engine (its layers; its fused RoPE, which
    the config refuses without it) and apex (fused weight-gradient accumulation: every
    ColumnParallelLinear, the output layer's too, raises without it). Without them the defaults
    are what runs: local layers, unfused RoPE and accumulation (the same arithmetic)."""
    defaults = {}
    if gpus.missing("transformer_engine"):
        defaults.update(transformer_impl="local", apply_rope_fusion=False)
    if gpus.missing("fused_weight_gradient_mlp_cuda"):
        defaults.update(gradient_accumulation_fusion=False)
    return defaults


def uses_torch_norms(args) -> bool:
    """Whether the local layers' norms are torch's (WrappedTorchNorm), which assert that the
    persistent LayerNorm is off: RMSNorm always, LayerNorm without apex (its FusedLayerNorm
    persists with apex.contrib's fast_layer_norm). Megatron-LM's GPU default has it on."""
    return args.transformer_impl == "local" and (args.normalization != "LayerNorm" or gpus.missing("fast_layer_norm"))


def from_first_parse(defaults: dict, args, on_cpu: bool, embedded: bool) -> None:
    """The defaults that follow from the values of a first parse, into `defaults`."""
    if embedded and not given("--lr-warmup-iters") and args.train_iters:
        # a shortened embedded run (--train-iters N) warms up for a tenth of it
        defaults["lr_warmup_iters"] = min(EMBEDDED_DEFAULTS["lr_warmup_iters"], args.train_iters // 10)
    if not on_cpu and uses_torch_norms(args):
        defaults["no_persist_layer_norm"] = True
    if embedded and not given("--load") and args.save:
        defaults["load"] = args.save  # the embedded default resumes from its own directory
    if embedded and not given("--tensorboard-dir") and args.save:
        # and keeps its curves beside its checkpoints (tools/plot_runs.py reads the --save directory)
        defaults["tensorboard_dir"] = os.path.join(args.save, "tensorboard")
    if embedded and not given("--log-file") and args.save:
        defaults["log_file"] = os.path.join(args.save, "train.log")
