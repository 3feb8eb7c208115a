"""Pretrain a GPT with DeepSeek-V3-style multi-token prediction on the patched megatron-core.

    torchrun --nproc-per-node 2 pretrain_gpt_mtp.py                 # embedded default
    torchrun --nproc-per-node 4 pretrain_gpt_mtp.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --mtp-num-layers 2 --train-iters 50

With no data arguments it trains a tiny byte-level GPT on an embedded text (the Zen of
Python), so it runs on a new machine with nothing downloaded. Runs on CPU (gloo) and on
GPUs (NCCL; Transformer Engine layers with --transformer-impl transformer_engine).
"""

import argparse
import sys
import time
import warnings

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--mtp-num-layers", type=int, default=1, help="MTP depths D (0 disables MTP)")
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1, help="lambda of the MTP loss")
    g.add_argument("--mtp-detach-heads", action="store_true",
                   help="isolate the MTP heads: no MTP gradient reaches the backbone, embedding or output "
                        "weight (depth chain stays connected); MTP parameters get their own grad norm")
    g.add_argument("--mtp-use-repeated-layer", action="store_true",
                   help="apply one MTP layer (mtp.layers.0) at every depth")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--main-loss-level", choices=["token", "sequence"], default="token",
                   help="main loss: mean over valid tokens of the step, or mean over valid sequences of "
                        "each sequence's token mean (the MTP term is always normalized by the token count)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default="local",
                   help="local: megatron-core layers with SDPA attention (any device)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--train-iters", type=int, default=50)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=5)
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory to write a dist checkpoint to at the end")
    g.add_argument("--load", help="directory of a dist checkpoint to start from")
    args = p.parse_args(argv)
    if args.mtp_num_layers < 0:
        p.error("--mtp-num-layers must be >= 0")
    if args.num_layers_per_virtual_pipeline_stage:
        per_stage, remainder = divmod(args.num_layers, args.pipeline_model_parallel_size)
        if remainder or per_stage % args.num_layers_per_virtual_pipeline_stage:
            p.error("--num-layers must split evenly into pipeline stages and virtual stages")
    return args


def format_log_line(iteration: int, total: int, result: dict, seconds_per_iter: float) -> str:
    parts = [f"iteration {iteration:5d}/{total}", f"lm loss {result['lm loss']:.4f}"]
    depth = 1
    while f"mtp_{depth} loss" in result:
        parts.append(f"mtp_{depth} loss {result[f'mtp_{depth} loss']:.4f} "
                     f"acc {result[f'mtp_{depth} acceptance']:.3f} "
                     f"chain {result[f'mtp_{depth} chain acceptance']:.3f}")
        depth += 1
    if depth > 1:
        parts.append(f"accepted length (incl. bonus) {result['expected accepted length (incl. bonus token)']:.3f}")
    parts.append(f"grad norm {result['grad norm']:.3f}")
    if "mtp grad norm" in result:
        parts.append(f"mtp grad norm {result['mtp grad norm']:.3f}")
    if result["skipped"]:
        parts.append("step skipped (overflow)")
    parts += [f"tokens {result['tokens']}", f"{seconds_per_iter:.3f} s/iter"]
    return " | ".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|cuda_graph_scope).*")
    from megatron_mtp.patched_core import PatchedCoreError, require_patched_core

    try:
        require_patched_core()
    except PatchedCoreError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2

    import torch.distributed as dist

    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_mtp.checkpointing import load_checkpoint, save_checkpoint
    from megatron_mtp.data import BYTE_VOCAB_SIZE, embedded_corpus, global_batch, rank_microbatches
    from megatron_mtp.initialize import initialize_distributed
    from megatron_mtp.model import build_model
    from megatron_mtp.step import train_step

    vpp = None
    if args.num_layers_per_virtual_pipeline_stage:
        vpp = args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
    initialize_distributed(args.tensor_model_parallel_size, args.pipeline_model_parallel_size, vpp, args.seed)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        mtp_num_layers=args.mtp_num_layers or None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        mtp_detach_heads=args.mtp_detach_heads,
        mtp_use_repeated_layer=args.mtp_use_repeated_layer,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        bf16=args.bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        calculate_per_token_loss=True,
    )
    chunks = build_model(config, BYTE_VOCAB_SIZE, args.seq_length,
                         use_distributed_optimizer=args.use_distributed_optimizer,
                         use_transformer_engine=args.transformer_impl == "transformer_engine",
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, clip_grad=args.clip_grad, bf16=args.bf16,
                        params_dtype=dtype, use_distributed_optimizer=args.use_distributed_optimizer),
        chunks,
    )
    if args.load:
        load_checkpoint(args.load, chunks, optimizer)

    corpus = embedded_corpus()
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"training a {args.num_layers}-layer GPT with {args.mtp_num_layers} MTP depth(s) on "
              f"{dist.get_world_size()} rank(s) (TP={args.tensor_model_parallel_size}, "
              f"PP={args.pipeline_model_parallel_size}), {corpus.numel()}-token embedded corpus", flush=True)
    start = time.perf_counter()
    for step in range(args.train_iters):
        tokens, loss_mask = global_batch(corpus, args.global_batch_size, args.seq_length, args.seed, step)
        result = train_step(chunks, optimizer, rank_microbatches(tokens, loss_mask, args.micro_batch_size),
                            args.seq_length, main_loss_level=args.main_loss_level)
        if rank0 and (step % args.log_interval == 0 or step == args.train_iters - 1):
            print(format_log_line(step + 1, args.train_iters, result, (time.perf_counter() - start) / (step + 1)),
                  flush=True)
    if args.save:
        save_checkpoint(args.save, chunks, optimizer)
        if rank0:
            print(f"saved checkpoint to {args.save}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
