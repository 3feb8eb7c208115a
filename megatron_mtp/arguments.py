# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Arguments of pretrain_gpt_mtp.py: Megatron-LM's flags, this script's defaults, and checks
that fail before anything is built, in one line (not one traceback per rank).

- On a machine without CUDA the defaults select what runs there (local layers, no fused
  CUDA kernels, CPU initialization, gloo); on GPUs, Megatron-LM's, except what needs a
  package that is not installed (Transformer Engine, apex: docs/gpus.md).
- With no data flag the run is the embedded default: a tiny GPT with 2 MTP depths on the
  embedded corpus (megatron_mtp.data.embedded), saving to runs/default.
- A dataset written by tools/preprocess_data.py names its vocabulary: the run takes it
  (NullTokenizer of that size and end-of-document id), or builds the --tokenizer-type /
  --tokenizer-model it is given when that tokenizer matches it, and refuses a contradicting one.
"""

import argparse
import contextlib
import glob
import io
import linecache
import os
import re
import signal
import sys
import threading
from functools import partial

from megatron_mtp import moe_arguments
from megatron_mtp.data.embedded import corpus_path, corpus_prefix, default_cache_dir
from megatron_mtp.data.indexed import DatasetError, check_dataset, read_metadata
from megatron_mtp.data.tokenizers import ByteTokenizer

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


class ArgumentError(ValueError):
    pass


def _provider(defaults: dict):
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


def _given(flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in sys.argv[1:])


def _defaults(on_cpu: bool, embedded: bool) -> dict:
    # Megatron-LM 0.19's loop needs an evaluation interval even without evaluation; 1000 was
    # its default before the flag lost it.
    # The model's attention is causal without a mask (SDPA, Transformer Engine) and forward_step
    # passes none: the dataloader does not build one per micro-batch (benchmarks/README.md).
    defaults = dict(calculate_per_token_loss=True, position_embedding_type="rope", eval_interval=1000,
                    create_attention_mask_in_dataloader=False)
    defaults.update(CPU_DEFAULTS if on_cpu else _gpu_defaults())
    if embedded:
        # the corpus is written once the arguments are accepted (_parse): a refused run writes nothing
        defaults.update(EMBEDDED_DEFAULTS, data_path=[str(corpus_path(default_cache_dir()))])
    return defaults


def _gpu_defaults() -> dict:
    """Megatron-LM's GPU defaults assume Transformer Engine (its layers; its fused RoPE, which
    the config refuses without it) and apex (fused weight-gradient accumulation: every
    ColumnParallelLinear, the output layer's too, raises without it). Without them the defaults
    are what runs: local layers, unfused RoPE and accumulation (the same arithmetic)."""
    defaults = {}
    if _missing("transformer_engine"):
        defaults.update(transformer_impl="local", apply_rope_fusion=False)
    if _missing("fused_weight_gradient_mlp_cuda"):
        defaults.update(gradient_accumulation_fusion=False)
    return defaults


def uses_torch_norms(args) -> bool:
    """Whether the local layers' norms are torch's (WrappedTorchNorm), which assert that the
    persistent LayerNorm is off: RMSNorm always, LayerNorm without apex (its FusedLayerNorm
    persists with apex.contrib's fast_layer_norm). Megatron-LM's GPU default has it on."""
    return args.transformer_impl == "local" and (args.normalization != "LayerNorm" or _missing("fast_layer_norm"))


def _vocabulary_from_data(args, defaults: dict, embedded: bool) -> None:
    """Tokenizer defaults from the datasets' metadata (the embedded corpus's: bytes, written or
    not yet); a contradiction is an error."""
    prefixes = [p for p in (args.data_path or []) if not is_weight(p)]
    found = {}
    if embedded:
        info = ByteTokenizer.info
        found, prefixes = {prefixes[0]: (info.vocab_size, info.eod_id, info.name)}, prefixes[1:]
    for prefix in prefixes:
        check_dataset(prefix)
        metadata = read_metadata(prefix)
        if metadata is not None:
            found[prefix] = (metadata["vocab_size"], metadata["eod_id"], metadata["tokenizer"])
    if not found:
        return
    if len(set(v[:2] for v in found.values())) > 1:
        raise ArgumentError("the datasets were written with different tokenizers: " + "; ".join(
            f"{p}: {t} (vocabulary {v}, end of document {e})" for p, (v, e, t) in found.items()))
    vocab_size, eod_id, tokenizer = next(iter(found.values()))
    if _given("--vocab-size") and args.vocab_size != vocab_size:
        raise ArgumentError(f"--vocab-size {args.vocab_size} does not match the dataset's tokenizer {tokenizer} "
                            f"(vocabulary {vocab_size}); drop --vocab-size or preprocess with the intended tokenizer")
    if _given("--tokenizer-type") and args.tokenizer_type != "NullTokenizer":
        # Megatron-LM's way: the tokenizer the data was written with, built as upstream builds it.
        from megatron_mtp.data.tokenizers import TokenizerError, UpstreamTokenizer

        try:
            given = UpstreamTokenizer(args).info
        except TokenizerError as error:
            raise ArgumentError(str(error)) from None
        if (given.vocab_size, given.eod_id) != (vocab_size, eod_id):
            raise ArgumentError(f"the dataset is tokenized by {tokenizer} (vocabulary {vocab_size}, end of document "
                                f"{eod_id}) but {given.name} has vocabulary {given.vocab_size}, end of document "
                                f"{given.eod_id}: its ids would not match (give the tokenizer the data was written "
                                "with, or drop --tokenizer-type to take the dataset's vocabulary)")
        return  # the run builds the tokenizer it was given, as Megatron-LM does
    defaults.update(tokenizer_type="NullTokenizer", vocab_size=vocab_size, null_tokenizer_eod_id=eod_id)


def _schedule_plan(args) -> None:
    """--overlap-moe-expert-parallel-comm runs the step through upstream's schedule plan
    (combined 1F1B, forward_step(..., return_schedule_plan=True)): CUDA streams and events
    only, and its MTP nodes re-implement the MTP layer outside the patched block."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False) or not args.mtp_num_layers:
        return
    raise ArgumentError("--overlap-moe-expert-parallel-comm runs the MTP layers through upstream's schedule plan "
                        "(combined 1F1B), which bypasses this project's exact MTP step (head isolation, repeated "
                        "layers, the last depth at the rows its loss reads): drop it, or train without "
                        "--mtp-num-layers")


def is_weight(item: str) -> bool:
    """A blend's weight in --data-path (the items are weight, prefix, weight, prefix, ...)."""
    try:
        float(item)
        return True
    except ValueError:
        return False


LOCAL_HYBRID_LAYERS = "*-EG"  # megatron.core.fork.runtime.specs.get_hybrid_stack_spec


def layers_needing_te(pattern: str | None) -> list[str]:
    """The layer symbols of a --hybrid-layer-pattern that the local (torch) hybrid stack does not
    build, sorted (Mamba's 'M' needs Transformer Engine and mamba-ssm's CUDA kernels)."""
    return sorted(set(pattern or "") - set(LOCAL_HYBRID_LAYERS) - set("|/"))


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def _gated_delta_net(args) -> bool:
    pattern = args.hybrid_layer_pattern or ""
    return "G" in pattern or getattr(args, "experimental_attention_variant", None) == "gated_delta_net"


def _check_gated_delta_net_kernels(args, on_gpu: bool) -> None:
    """Upstream's Gated DeltaNet computes with flash-linear-attention's kernels on GPUs (the
    runtime part's PyTorch forms serve machines without CUDA only)."""
    if on_gpu and _gated_delta_net(args) and not args.dry_run and _missing("fla"):
        raise ArgumentError("Gated DeltaNet layers on GPUs compute with flash-linear-attention's kernels "
                            "(upstream's), which is not installed: pip install flash-linear-attention")


def _check(args) -> None:
    """What neither Megatron-LM's validate_args nor the TransformerConfig's checks (upstream's
    and the fork's MTP options, megatron.core.fork.mtp.options) refuse, or refuse only once
    something is built, in one message. Theirs reach the user as one line too (`fail`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        value = getattr(args, name)
        if value is None or value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    for name in ("train_iters", "global_batch_size", "save_interval", "eval_interval", "log_interval"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.lr is None:
        raise ArgumentError("give --lr (the peak learning rate)")
    if args.train_iters is None and args.train_samples is None:
        raise ArgumentError("give --train-iters (or --train-samples)")
    if args.eval_iters is not None and args.eval_iters < 0:
        raise ArgumentError(f"--eval-iters must be >= 0, got {args.eval_iters}")
    if cp > 1 and args.seq_length % (2 * cp):
        raise ArgumentError(f"--seq-length {args.seq_length} does not split into 2 x --context-parallel-size = "
                            f"{2 * cp} equal chunks (upstream's load-balanced layout): use a multiple of {2 * cp}")
    dp, uneven = divmod(world, tp * pp * cp)  # uneven: Megatron-LM's validate_args refuses the world size
    if args.global_batch_size is not None and not uneven and args.global_batch_size % (args.micro_batch_size * dp):
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                            f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    decay = args.lr_decay_iters or args.train_iters
    if decay is not None and args.lr_warmup_iters >= decay:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be below the decay length "
                            f"(--lr-decay-iters, else --train-iters) {decay}")
    depths = args.mtp_num_layers or 0
    if args.sparse_lm_loss and args.main_loss_level == "sequence":
        raise ArgumentError("--sparse-lm-loss needs the token-level main loss (its per-token losses weighted by "
                            "the loss mask); drop it or use --main-loss-level token")
    if args.freeze_backbone and not (depths and args.mtp_detach_heads):
        raise ArgumentError("--freeze-backbone trains the MTP heads only: it needs --mtp-num-layers D >= 1 and "
                            "--mtp-detach-heads (isolation keeps the heads' loss off the frozen backbone)")
    if args.transformer_impl == "transformer_engine" and not args.dry_run and _missing("transformer_engine"):
        raise ArgumentError("--transformer-impl transformer_engine needs Transformer Engine, which is not installed "
                            "(pip install -e '.[gpu]'), or --transformer-impl local")
    pattern = args.hybrid_layer_pattern
    if pattern is not None and args.transformer_impl != "transformer_engine":
        others = layers_needing_te(pattern)
        if others:
            raise ArgumentError(f"--hybrid-layer-pattern layers {' '.join(others)} need Transformer Engine (Mamba 'M' "
                                "also mamba-ssm's CUDA kernels); without it the hybrid layers are attention '*', "
                                "MLP '-', MoE 'E' (with --num-experts) and Gated DeltaNet 'G'")
        if "E" in pattern and not args.num_experts:
            raise ArgumentError("--hybrid-layer-pattern has MoE layers 'E': give --num-experts")
    import torch

    _check_gated_delta_net_kernels(args, on_gpu=torch.cuda.is_available())
    if _gated_delta_net(args) and not args.swiglu:
        # GatedDeltaNet's convolution (FLA's causal_conv1d, or its PyTorch form here) takes SiLU only,
        # and the layer gates its output with the same activation.
        raise ArgumentError("Gated DeltaNet layers (--hybrid-layer-pattern 'G', --experimental-attention-variant "
                            "gated_delta_net) use the model's activation in their convolution and output gate, SiLU "
                            "only (upstream's): give --swiglu")
    if args.reset_attention_mask:
        # Megatron-LM's pretrain_gpt.py passes the dataset's per-document mask to the model; this
        # trainer passes none (its attention is causal without one), so the flag would do nothing.
        raise ArgumentError("--reset-attention-mask is not supported: this trainer's attention is causal over the "
                            "whole sequence (no mask is passed to the model), so documents would still attend "
                            "across their boundaries; drop it (--reset-position-ids still restarts positions)")
    moe_arguments.check(args, world, ArgumentError)
    if args.load is not None and not os.path.isdir(args.load) and not args.save == args.load:
        raise ArgumentError(f"--load {args.load}: no such directory")
    if args.load is not None and os.path.isdir(args.load):
        from megatron.core.fork.fixes import checkpoint_files

        checkpoint_files.verify(args.load, args.ckpt_step)  # names a damaged file before anything is built


def _shape_of(args) -> dict:
    """The model_shape (megatron.core.fork.training_loop.model_shape) the arguments build, without building it."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.core.fork.training_loop.model_shape import config_shape

    shape = config_shape(core_transformer_config_from_args(args), args.hybrid_layer_pattern)
    shape["vocab_size"] = args.padded_vocab_size
    shape["share_embeddings_and_output_weights"] = not args.untie_embeddings_and_output_weights
    return shape


def _check_checkpoints(args) -> None:
    """Nothing a run did not load is overwritten: a --save directory that holds checkpoints is
    written only by the run that resumes from its latest one. A checkpoint of another shape
    is refused here, before anything is built (the load checks again)."""
    from megatron.core.fork.fixes import checkpoint_files
    from megatron.core.fork.training_loop import checkpoint

    loads_from_save = (args.load is not None and args.save is not None
                       and os.path.realpath(args.load) == os.path.realpath(args.save))
    if args.load is not None and os.path.isdir(args.load):
        saved = checkpoint.saved_entry(args.load, args.ckpt_step)
        if saved is not None and loads_from_save and not _given("--load"):  # the embedded default's directory
            shape = _shape_of(args)
            differences = [f"{field}: checkpoint {value!r}, this run {shape.get(field)!r}"
                           for field, value in sorted(saved["model_shape"].items()) if shape.get(field) != value]
            if differences:
                raise ArgumentError(f"--save {args.save} holds checkpoints of another model that this run would "
                                    f"overwrite ({'; '.join(differences)}): give another --save for this run, "
                                    f"or resume them with --load {args.save} and their model flags")
        try:
            checkpoint.check_shape(saved, _shape_of(args), args.finetune)
        except checkpoint_files.CheckpointError as error:
            if not loads_from_save:
                raise
            # resuming was not the point: the way out is a directory of this run's own
            raise ArgumentError(f"{error} Or give this run another --save: its --load is its --save, "
                                f"{args.save}") from None
        if saved is not None and args.finetune and not _given("--dist-ckpt-strictness") and \
                (saved["model_shape"].get("mtp_num_layers") or 0) < (args.mtp_num_layers or 0):
            # heads added to a pretrained model: their tensors are not in the checkpoint and keep
            # their initialization (the shape check has compared everything else)
            args.dist_ckpt_strictness = "log_all"
    if args.save is None or not os.path.isdir(args.save):
        return
    latest = checkpoint_files.tracked_iteration(args.save)
    if latest is None:
        return
    if not loads_from_save:
        why = "it loads none" if args.load is None else f"it loads {args.load}"
    elif args.finetune:
        why = "--finetune restarts at iteration 0"
    elif args.ckpt_step is not None and args.ckpt_step != latest:
        # --load is already that directory: only another --save goes on from the earlier step
        raise ArgumentError(f"--save {args.save} holds checkpoints up to iteration {latest} that this run would "
                            f"overwrite (it resumes from iteration {args.ckpt_step} (--ckpt-step)): keep --load "
                            f"{args.load} --ckpt-step {args.ckpt_step} and give another --save")
    else:
        return
    raise ArgumentError(f"--save {args.save} holds checkpoints up to iteration {latest} that this run would "
                        f"overwrite ({why}): resume them with --load {args.save}, or give another --save")


def finished(args) -> str | None:
    """The line that says a run has nothing left to train (it resumes at or past --train-iters)."""
    from megatron.core.fork.fixes import checkpoint_files

    if args.load is None or args.finetune or args.skip_train or not args.train_iters \
            or not os.path.isdir(args.load):
        return None
    iteration = args.ckpt_step if args.ckpt_step is not None else checkpoint_files.tracked_iteration(args.load)
    if not iteration or iteration < args.train_iters:
        return None
    return (f"pretrain_gpt_mtp.py: {args.load} holds a finished run (iteration {iteration} of --train-iters "
            f"{args.train_iters}), nothing to train: to train on, give --train-iters N above {iteration} with "
            f"--use-checkpoint-opt_param-scheduler (its learning-rate schedule continues), or another --save "
            f"to start afresh")


def _nvidia_devices() -> list[str]:
    """The NVIDIA GPUs the kernel driver exposes: device nodes, or the driver's /proc entries."""
    return sorted(glob.glob("/dev/nvidia[0-9]*")) or sorted(glob.glob("/proc/driver/nvidia/gpus/*"))


def _unusable_gpus() -> str | None:
    """Why a machine with NVIDIA GPUs cannot use them (torch finds no CUDA), or None: the CPU
    defaults are for machines without GPUs, or runs that hide them (CUDA_VISIBLE_DEVICES=)."""
    import torch

    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return None
    devices = _nvidia_devices()
    if not devices:
        return None
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    else:
        try:
            torch.cuda.init()
            why = "torch sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver)"
        except Exception as error:  # the driver's own reason
            why = " ".join(str(error).split())[:300] or type(error).__name__
    return (f"this machine has NVIDIA GPUs ({', '.join(devices[:2])}{', ...' if len(devices) > 2 else ''}) but "
            f"CUDA is unusable: {why}; fix that, or set CUDA_VISIBLE_DEVICES= to train on the CPU on purpose")


# Upstream's checks stay the source of a refusal; the frequent ones, which name config fields or
# print a bare assert, are said first in flags: (pattern of the one-line refusal, hint).
FLAG_HINTS = (
    (re.compile(r"assert args\.save_interval is not None"),
     "--save needs --save-interval N (every N iterations a checkpoint)"),
    (re.compile(r"assert args\.hidden_size % args\.num_attention_heads == 0"),
     "--hidden-size must be a multiple of --num-attention-heads"),
    (re.compile(r"num_attention_heads \((\d+)\) must be a multiple of tensor_model_parallel_size \((\d+)\)"),
     "--tensor-model-parallel-size {2} does not divide --num-attention-heads {1}: choose a tensor-parallel size that "
     "divides the heads"),
    (re.compile(r"max_position_embeddings \((\d+)\) must be greater than or equal to seq_length \((\d+)\)"),
     "--seq-length {2} exceeds --max-position-embeddings {1}: raise --max-position-embeddings or shorten "
     "--seq-length"),
)


def _with_hint(text: str) -> str:
    for pattern, hint in FLAG_HINTS:
        match = pattern.search(text)
        if match:
            return f"{hint.format(None, *match.groups())} (Megatron-LM: {text})"
    return text


def _one_line(error: BaseException | str) -> str:
    text = " ".join(str(error).split())
    if text:
        return _with_hint(text)
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    if frame is None:
        return "Megatron-LM refused the arguments"
    filename = frame.tb_frame.f_code.co_filename
    statement = linecache.getline(filename, frame.tb_lineno).strip()
    text = f"{statement} ({filename.rsplit('/', 1)[-1]}:{frame.tb_lineno})"
    hinted = _with_hint(text)
    return hinted if hinted != text else f"Megatron-LM refused the arguments: {text}"


def fail(error: BaseException | str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"pretrain_gpt_mtp.py: error: {_one_line(error)}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _reporting_rank_finishes_its_checks():
    """Every rank refuses the same arguments, and rank 0 alone prints why; a rank that refuses
    first exits, and torchrun then stops the others with SIGTERM, which would end rank 0 before
    its line (it checks more slowly: it prints Megatron-LM's argument list). So rank 0 holds
    SIGTERM until its checks are done, prints its line if it refuses, then takes the signal."""
    if os.environ.get("RANK", "0") != "0" or threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []

    def hold(signum, _frame):
        held.append(signum)

    previous = signal.signal(signal.SIGTERM, hold)
    try:
        yield
    finally:
        # Megatron-LM's --exit-signal-handler installs its handler while the arguments are
        # validated: it stays (it holds the signal for the training loop itself).
        if signal.getsignal(signal.SIGTERM) is hold:
            signal.signal(signal.SIGTERM, previous)
        if held:
            os.kill(os.getpid(), signal.SIGTERM)


def parse():
    """Megatron-LM's parsed and validated arguments with this script's defaults; None (after
    one error line) if they are refused."""
    with _reporting_rank_finishes_its_checks():
        return _parse()


def _parse():
    from megatron_mtp.patched_core import PatchedCoreError, require_patched_core

    try:
        require_patched_core()
    except PatchedCoreError as error:
        fail(error)
        return None
    import torch
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from megatron.core.fork.fixes import checkpoint_files

    on_cpu = not torch.cuda.is_available()
    unusable = _unusable_gpus() if on_cpu else None
    if unusable:
        fail(unusable)
        return None
    if on_cpu:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM's TP check; moot on CPU
    embedded = not any(_given(flag) for flag in DATA_FLAGS)
    # argparse's own errors (an unknown flag, a bad value) print usage and exit: on rank 0 only.
    quiet = contextlib.redirect_stderr(io.StringIO()) if os.environ.get("RANK", "0") != "0" \
        else contextlib.nullcontext()
    try:
        with quiet:
            defaults = _defaults(on_cpu, embedded)
            args = parse_args(_provider(defaults))
            _vocabulary_from_data(args, defaults, embedded)
            _schedule_plan(args)
            if embedded and not _given("--lr-warmup-iters") and args.train_iters:
                # a shortened embedded run (--train-iters N) warms up for a tenth of it
                defaults["lr_warmup_iters"] = min(EMBEDDED_DEFAULTS["lr_warmup_iters"], args.train_iters // 10)
            if not on_cpu and uses_torch_norms(args):
                defaults["no_persist_layer_norm"] = True
            if embedded and not _given("--load") and args.save:
                defaults["load"] = args.save  # the embedded default resumes from its own directory
            if embedded and not _given("--tensorboard-dir") and args.save:
                # and keeps its curves beside its checkpoints (tools/plot_runs.py reads the --save directory)
                defaults["tensorboard_dir"] = os.path.join(args.save, "tensorboard")
            if embedded and not _given("--log-file") and args.save:
                defaults["log_file"] = os.path.join(args.save, "train.log")
            args = parse_args(_provider(defaults))
        _check(args)
        deferred = _capability_deferred(args)
        with quiet, _without_argument("--moe-grouped-gemm") if deferred else contextlib.nullcontext(), \
                _without_writers() if args.dry_run or finished(args) else contextlib.nullcontext(), \
                _checked_before_anything_is_written(partial(_check_config, deferred=deferred), _check_checkpoints):
            args = parse_and_validate_args(_provider(defaults))
        if embedded and not args.dry_run:
            corpus_prefix(default_cache_dir())
        return args
    except (ArgumentError, DatasetError, checkpoint_files.CheckpointError, AssertionError, ValueError,
            TypeError) as error:
        fail(error)
        return None
    except SystemExit as exit:
        if not exit.code:
            raise  # --help
        return None  # argparse has printed its message


def _check_config(args, deferred: bool) -> None:
    """The TransformerConfig's own checks (upstream's and the MTP options',
    megatron.core.fork.mtp.options), which need Megatron-LM's validated arguments."""
    from megatron.training.arguments import core_transformer_config_from_args

    args.moe_grouped_gemm |= deferred
    core_transformer_config_from_args(args)


@contextlib.contextmanager
def _checked_before_anything_is_written(check_config, check_built):
    """Megatron-LM's parse_and_validate_args prints the argument list at the end of validate_args,
    then set_global_variables builds the tokenizer (the padded vocabulary) and the TensorBoard and
    W&B writers (their directories, an events file). `check_config(args)` runs before the list
    is printed, `check_built(args)` (the checkpoints': the padded vocabulary is a shape) once the
    tokenizer is built, before the writers; the list comes after both: a refused run prints its
    one line first and writes nothing."""
    from megatron.training import arguments as upstream
    from megatron.training import global_vars

    print_args, set_global_variables = upstream._print_args, upstream.set_global_variables
    held = []

    def checked_first(args, *given, **options):
        check_config(args)
        writers = global_vars._set_tensorboard_writer, global_vars._set_wandb_writer
        global_vars._set_tensorboard_writer = global_vars._set_wandb_writer = lambda args: None
        try:
            result = set_global_variables(args, *given, **options)
        finally:
            global_vars._set_tensorboard_writer, global_vars._set_wandb_writer = writers
        check_built(args)
        for title, printed in held:
            print_args(title, printed)
        for set_writer in writers:
            set_writer(args)
        return result

    upstream._print_args = lambda title, args: held.append((title, args))
    upstream.set_global_variables = checked_first
    try:
        yield
    finally:
        upstream._print_args, upstream.set_global_variables = print_args, set_global_variables


def _capability_deferred(args) -> bool:
    """A --dry-run for GPUs (moe_arguments.targets_cuda) on a machine without CUDA: Megatron-LM's
    validate_args asks the GPU's compute capability for --moe-grouped-gemm (>= 8.0), which only
    that GPU answers; the dry run validates everything else, the run checks it when it starts."""
    import torch

    return args.moe_grouped_gemm and not torch.cuda.is_available() and moe_arguments.targets_cuda(args)


@contextlib.contextmanager
def _without_writers():
    """Megatron-LM's global setup without its TensorBoard and W&B writers, which create their
    directories and an events file: a dry run, or a rerun of a finished run, writes nothing."""
    from megatron.training import global_vars

    writers = global_vars._set_tensorboard_writer, global_vars._set_wandb_writer
    global_vars._set_tensorboard_writer = global_vars._set_wandb_writer = lambda args: None
    try:
        yield
    finally:
        global_vars._set_tensorboard_writer, global_vars._set_wandb_writer = writers


@contextlib.contextmanager
def _without_argument(flag: str):
    argv = sys.argv
    sys.argv = [arg for arg in argv if arg != flag]
    try:
        yield
    finally:
        sys.argv = argv


def summary(args, parameters: int | str) -> str:
    """One line that says what a run would be (--dry-run), with the model's `parameters` (a count,
    or why there is none)."""
    data = "mock data" if args.mock_data else " ".join(args.data_path or []) or "per-split data paths"
    mtp = (f"MTP D={args.mtp_num_layers}{' repeated' if args.mtp_use_repeated_layer else ''}"
           f"{' isolated' if args.mtp_detach_heads else ''}{' frozen backbone' if args.freeze_backbone else ''}, "
           + (f"sparse MTP loss in chunks of {args.sparse_loss_chunk_size} rows" if args.mtp_sparse_loss
              else "dense MTP loss")
           if args.mtp_num_layers else "no MTP")
    attention = ("multi-latent attention" if args.multi_latent_attention
                 else f"grouped-query attention, {args.num_query_groups} groups" if args.group_query_attention
                 else "multi-head attention")
    return (f"pretrain_gpt_mtp.py: arguments OK: world {args.world_size} = DP {args.data_parallel_size} x "
            f"TP {args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size}"
            + (f" (VPP {args.virtual_pipeline_model_parallel_size})" if args.virtual_pipeline_model_parallel_size
               else "") +
            f" x CP {args.context_parallel_size}; "
            f"{f'HybridModel {args.hybrid_layer_pattern!r}, ' if args.hybrid_layer_pattern else ''}"
            f"{args.num_layers} layers, hidden {args.hidden_size}, "
            f"{args.num_attention_heads} heads ({attention}), vocabulary {args.padded_vocab_size}, "
            f"parameters: {_count(parameters)}; {mtp}; "
            + (f"{args.num_experts} experts (top-{args.moe_router_topk}"
               f"{', grouped GEMM' if args.moe_grouped_gemm else ''}), EP {args.expert_model_parallel_size}"
               f"{' (compute capability checked on the GPUs)' if _capability_deferred(args) else ''}; "
               if args.num_experts else "") +
            f"{'sparse lm loss; ' if args.sparse_lm_loss else ''}"
            f"{args.transformer_impl} layers, {'bf16' if args.bf16 else 'fp16' if args.fp16 else 'fp32'}; "
            f"{args.train_iters} iterations of {args.global_batch_size} x {args.seq_length} tokens; data: {data}; "
            f"load: {args.load or '-'}, save: {args.save or '-'}")


def _count(parameters: int | str) -> str:
    if isinstance(parameters, str):
        return parameters
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if parameters >= size:
            return f"{parameters:,} ({parameters / size:.1f}{unit})"
    return f"{parameters:,}"
