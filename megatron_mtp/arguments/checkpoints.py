# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The checkpoint directories a run names: what --load holds is checked before anything is built,
and nothing a run did not load is overwritten; a run that has nothing left to train says so."""

import os

from megatron_mtp.arguments.defaults import given
from megatron_mtp.arguments.errors import ArgumentError


def check_load(args) -> None:
    """--load names a directory (or the --save this run creates), whose files are whole."""
    if args.load is not None and not os.path.isdir(args.load) and not args.save == args.load:
        raise ArgumentError(f"--load {args.load}: no such directory")
    if args.load is not None and os.path.isdir(args.load):
        from megatron.core.fork.upstream_fixes import checkpoint_files

        checkpoint_files.verify(args.load, args.ckpt_step)  # names a damaged file before anything is built


def _shape_of(args) -> dict:
    """The model_shape (megatron.core.fork.training_loop.model_shape) the arguments build, without building it."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron.core.fork.training_loop.model_shape import config_shape

    shape = config_shape(core_transformer_config_from_args(args), args.hybrid_layer_pattern)
    shape["vocab_size"] = args.padded_vocab_size
    shape["share_embeddings_and_output_weights"] = not args.untie_embeddings_and_output_weights
    return shape


def check(args) -> None:
    """Nothing a run did not load is overwritten: a --save directory that holds checkpoints is
    written only by the run that resumes from its latest one. A checkpoint of another shape
    is refused here, before anything is built (the load checks again)."""
    from megatron.core.fork.training_loop import checkpoint
    from megatron.core.fork.upstream_fixes import checkpoint_files

    loads_from_save = (args.load is not None and args.save is not None
                       and os.path.realpath(args.load) == os.path.realpath(args.save))
    if args.load is not None and os.path.isdir(args.load):
        saved = checkpoint.saved_entry(args.load, args.ckpt_step)
        if saved is not None and loads_from_save and not given("--load"):  # the embedded default's directory
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
        if saved is not None and args.finetune and not given("--dist-ckpt-strictness") and \
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
    from megatron.core.fork.upstream_fixes import checkpoint_files

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
