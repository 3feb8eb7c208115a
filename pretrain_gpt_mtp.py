# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Pretrain a GPT with DeepSeek-V3-style multi-token prediction on Megatron-LM's training loop.

    torchrun --nproc-per-node 2 pretrain_gpt_mtp.py        # embedded default: tiny GPT, D = 2, CPU or GPU
    torchrun --nproc-per-node 8 pretrain_gpt_mtp.py --data-path data/corpus_text_document \\
        --num-layers 24 --hidden-size 2048 ... --mtp-num-layers 1    # every Megatron-LM flag

Like Megatron-LM's pretrain_gpt.py, this script provides the model, the datasets and the
forward step and calls megatron.training.pretrain(), which provides the flags, schedules,
evaluation, checkpointing (--save-interval, resume), --exit-signal-handler,
--exit-duration-in-mins and TensorBoard/W&B logging. The patch series makes every step
the spec's objective (counts up front, one normalization, separate MTP clipping under
--mtp-detach-heads) and logs per-depth MTP metrics. With no data flag it trains on the
embedded default corpus (the Python Language Reference's topics, tokenized as bytes).
This script adds five flags: --main-loss-level {token,sequence}, --freeze-backbone (train the
MTP heads only), --create-attention-mask-in-dataloader (off by default here), --dry-run (check
everything, build nothing) and --log-file (the console output kept in a file); datasets written
by tools/preprocess_data.py carry their vocabulary, which --data-path takes from them. The
embedded default also keeps TensorBoard and its console log in its --save directory and saves
on SIGTERM (--exit-signal-handler); with that handler, Ctrl-C (SIGINT) saves as the exit signal
does. `python -m megatron_mtp.launch` in torchrun's place exits 0 once the workers have saved
after a signal to it (torchrun exits 1).
"""

import os
import signal
import sys
import warnings
from functools import partial

# No module-level import of torch or megatron: megatron-core's asynchronous checkpoint saves
# (--async-save) start multiprocessing "spawn" helpers, which re-import this file (as
# __mp_main__) in a fresh interpreter; what is imported here, each helper imports again.


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """GPTModel with its MTP block on the last stage, its layers chosen as Megatron-LM's
    gpt_builders.py chooses them (--spec, --experimental-attention-variant, MoE block specs,
    --qk-layernorm, --multi-latent-attention, ...): Transformer Engine layers, or megatron-core's
    local layers with SDPA core attention (any device, packed rows). With
    --hybrid-layer-pattern, HybridModel (its MTP depths are the pattern's "/" parts). One
    builder for the trainer, the library and serving (megatron_mtp.library.model)."""
    from megatron.core.transformer.spec_utils import import_module
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_mtp.library.model import build_gpt, build_hybrid, gpt_options

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    common = dict(use_transformer_engine=args.transformer_impl == "transformer_engine", vp_stage=vp_stage,
                  pre_process=pre_process, post_process=post_process, pg_collection=pg_collection,
                  **gpt_options(args))
    if args.hybrid_layer_pattern is not None:
        model = build_hybrid(config, args.padded_vocab_size, args.max_position_embeddings,
                             args.hybrid_layer_pattern, **common)
    else:
        layer_spec = import_module(args.spec) if args.spec is not None else None
        model = build_gpt(config, args.padded_vocab_size, args.max_position_embeddings, layer_spec=layer_spec,
                          **common)
    if getattr(args, "freeze_backbone", False):  # this script's flag: the MTP heads train, the backbone is frozen
        for name, parameter in model.named_parameters():
            if not name.startswith("mtp."):
                parameter.requires_grad_(False)
        for name, module in model.named_modules():
            # a router's expert bias moves with its token counts, not its gradient (aux-loss-free balancing)
            if hasattr(module, "frozen_expert_bias") and not name.startswith("mtp."):
                module.frozen_expert_bias = True
    return model


def count_parameters(args) -> int | str:
    """The model's parameters, each counted once, without building it on a device: model_provider's
    model at TP = PP = EP = CP = 1 with local layers (the tensors of every layout together, of
    Transformer Engine's layers too) on the meta device, in a process group of this process alone.
    A model only Transformer Engine builds (Mamba layers) gives the reason instead: the local
    HybridModel stack would leave those layers empty."""
    import argparse

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.training import global_vars
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.core.fork.runtime.specs import SpecError
    from megatron_mtp.arguments.checks import layers_needing_te
    from megatron_mtp.library.initialize import initialize_model_parallel
    from megatron_mtp.serving.model import MOE_KERNELS, ONE_PROCESS

    others = layers_needing_te(args.hybrid_layer_pattern)
    if others:
        return f"not counted without Transformer Engine (HybridModel layers {' '.join(others)})"
    whole = argparse.Namespace(**{**vars(args), **ONE_PROCESS, **dict.fromkeys(MOE_KERNELS, False)})
    whole.pipeline_model_parallel_layout = None
    whole.perform_initialization, whole.use_cpu_initialization = False, True
    if whole.hybrid_layer_pattern is not None:
        whole.hybrid_layer_pattern = whole.hybrid_layer_pattern.replace("|", "")  # one stage
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    global_vars.set_args(whole)  # model_provider reads the global arguments
    try:
        initialize_model_parallel(1, 1, None, args.seed)
        with torch.device("meta"):
            model = model_provider(config=core_transformer_config_from_args(whole))
        return sum(parameter.numel() for parameter in model.parameters())
    except (SpecError, AssertionError, ValueError, ImportError) as error:
        return f"not counted with local layers ({' '.join(str(error).split())})"
    finally:
        global_vars.set_args(args)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def datasets_provider(train_valid_test_num_samples, vp_stage=None):
    """megatron-core's GPT datasets (blends and splits by --data-path / --split), or mock data."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training import get_args
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_valid_test_num_samples,
                                         partial(is_dataset_built_on_rank, vp_stage=vp_stage), config).build()


def _mtp_here(vp_stage=None) -> bool:
    """Whether this rank (this virtual stage) holds MTP layers."""
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from megatron.training import get_args

    args = get_args()
    if not args.mtp_num_layers:
        return False
    layout = None
    if args.pipeline_model_parallel_layout is not None:  # e.g. "Et*2|m|L": MTP on a stage of its own
        layout = PipelineParallelLayerLayout.from_str(layout=args.pipeline_model_parallel_layout,
                                                      pipeline_model_parallel_size=args.pipeline_model_parallel_size)
    return mtp_on_this_rank(layout=layout, mtp_num_layers=args.mtp_num_layers, ignore_virtual=vp_stage is None,
                            vp_stage=vp_stage)


def is_dataset_built_on_rank(vp_stage=None) -> bool:
    """As Megatron-LM's pretrain_gpt.py: the datasets are built where get_batch reads them
    (tensor-parallel rank 0 of the first and last stage, and here of every MTP stage)."""
    from megatron.core import parallel_state
    from megatron.training.utils import is_first_or_last_pipeline_stage

    return parallel_state.get_tensor_model_parallel_rank() == 0 and (
        is_first_or_last_pipeline_stage(vp_stage) or _mtp_here(vp_stage))


def get_embedding_ranks(pp_ranks):
    """As Megatron-LM's pretrain_gpt.py: the word-embedding group holds the first stage, the
    last when embeddings and output weights are tied, and every stage with MTP layers (each
    holds a copy of the embedding)."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_mtp.library.initialize import embedding_ranks

    args = get_args()
    if len(pp_ranks) == 1:
        return list(pp_ranks)
    return embedding_ranks(pp_ranks, not args.untie_embeddings_and_output_weights,
                           core_transformer_config_from_args(args))


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch: read on tensor-parallel rank 0, broadcast to the others, then
    cut for this context-parallel rank (upstream's load-balanced split); nothing on pipeline
    stages that neither embed nor compute a loss."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank
    from megatron.training import get_args

    from megatron.core.fork.runtime import device as compute_device

    args = get_args()
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    mtp_here = _mtp_here(vp_stage)
    if not (first or last or mtp_here):
        return None, None, None, None
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        batch = {key: (value.to(compute_device.current_device()) if torch.is_tensor(value) else value)
                 for key, value in next(data_iterator).items()}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=False, is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size, seq_length=args.seq_length, mtp_on_this_rank=mtp_here,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last,
    )
    if args.context_parallel_size > 1:
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"]


# Megatron-LM's pretrain_gpt.py: a loss 10 times the largest of the first 100 observed is spiky.
SPIKY_LOSS_FACTOR = 10


def loss_func(loss_mask, output_tensor, model=None):
    """The exact main loss at the step's level (megatron.core.fork.mtp.step.main_loss),
    reported as [sum, count] so that upstream's loop reduces it into the exact mean. As
    Megatron-LM's pretrain_gpt.py, this rank's raw loss sum goes through the rerun state
    machine before any reduction: NaN or Inf (--check-for-nan-in-loss-and-grad, on by
    default) and, with --check-for-spiky-loss, a spike."""
    import torch
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training import get_args

    from megatron.core.fork.mtp.step import main_loss

    args = get_args()
    loss, count, report = main_loss(output_tensor, loss_mask)
    main_sum = report["main loss sums"][0]
    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        for reject, found in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            rerun_state_machine.validate_result(result=main_sum, rejection_func=reject,
                                                message=f"found {found} in local forward loss calculation",
                                                tolerance=0.0, fatal=True)  # the forward is deterministic
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=main_sum, rejection_func=partial(rerun_state_machine.is_unexpectedly_large,
                                                    threshold=SPIKY_LOSS_FACTOR, context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)
    return loss, count, {"lm loss": torch.stack([main_sum, count.to(main_sum.dtype)])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """As Megatron-LM's pretrain_gpt.py. The attention is causal without a mask (SDPA,
    Transformer Engine): none is passed. `return_schedule_plan` (upstream's combined 1F1B
    schedule, --overlap-moe-expert-parallel-comm: CUDA only, refused with MTP depths by
    megatron_mtp.arguments) returns the model's schedule plan instead of its output."""
    from megatron.core.utils import get_attr_wrapped_model

    tokens, labels, loss_mask, position_ids = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def main() -> int:
    last_rank = int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    if not last_rank:  # every rank would print the same upstream warnings: the last prints them, once
        warnings.simplefilter("ignore")
    from megatron_mtp import arguments
    from megatron_mtp.arguments.checkpoints import finished
    from megatron_mtp.arguments.dry_run import summary

    args = arguments.parse()
    if args is None:
        return 2
    if args.dry_run:
        if os.environ.get("RANK", "0") == "0":
            print(summary(args, count_parameters(args)), flush=True)
        return 0
    done = finished(args)
    if done:  # rerunning a finished run trains nothing and overwrites nothing
        if os.environ.get("RANK", "0") == "0":
            print(done, flush=True)
        return 0
    if args.log_file and last_rank:
        from megatron_mtp import console_log

        console_log.tee(args.log_file)
    from megatron.core.fork.training_loop import exact_step

    exact_step.enable(args.main_loss_level)
    datasets_provider.is_distributed = True
    if args.exit_signal_handler and args.exit_signal != signal.SIGINT:
        signal.signal(signal.SIGINT, partial(_as_exit_signal, args.exit_signal))
    try:
        return _pretrain(args)
    finally:
        if args.exit_signal_handler:
            # The run has saved and is leaving: a repeated exit signal (a scheduler may send it
            # again, Ctrl-C reaches torchrun and its workers alike) must not kill the process while
            # the interpreter shuts down.
            signal.signal(args.exit_signal, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _as_exit_signal(exit_signal, signum, frame):
    """Ctrl-C (SIGINT) stops the run as the exit signal does (upstream's handler takes one signal):
    once Megatron-LM's handler for it is installed, the run saves and exits 0; before, nothing is
    trained yet and Ctrl-C interrupts as always."""
    handler = signal.getsignal(exit_signal)
    if not callable(handler):
        raise KeyboardInterrupt
    handler(exit_signal, frame)


def _pretrain(args) -> int:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron.core.fork.mtp.step import StepRefused
    from megatron.core.fork.runtime.specs import SpecError
    from megatron.core.fork.upstream_fixes import checkpoint_files
    from megatron_mtp.arguments.errors import fail

    try:
        pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
                 forward_step, model_provider=model_provider, get_embedding_ranks=get_embedding_ranks)
    except (checkpoint_files.CheckpointError, StepRefused) as error:  # raised alike on every rank: one line
        fail(error)
        return 1
    except SpecError as error:  # a flag the selected layer specs do not build, refused before the model is
        fail(error)
        return 2
    except AssertionError as error:
        if not str(error).startswith("OptimizerParamScheduler"):
            raise
        fail(f"{error} (the checkpoint's learning-rate schedule differs from this run's: resume with "
             "its values, or add --override-opt_param-scheduler to take this run's, or "
             "--use-checkpoint-opt_param-scheduler to keep the checkpoint's)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
