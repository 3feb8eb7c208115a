# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Arguments of pretrain_gpt_mtp.py: Megatron-LM's flags, this script's defaults, and checks
that fail before anything is built, in one line (not one traceback per rank). `parse` runs them
in order; each concern is a module here:

- defaults: the flags this script adds, its defaults (the CPU's, the GPUs' by what is installed,
  the embedded default run's);
- vocabulary: the vocabulary a dataset names, taken or checked against the tokenizer given;
- checks: the arguments' own checks;
- checkpoints: the checkpoint directories (--load whole and of this model, --save not overwritten,
  a finished run);
- gpus: what the machine has (packages, NVIDIA GPUs, usable CUDA);
- errors: the one line a refusal prints, from rank 0, with the flag to change;
- dry_run: the line --dry-run prints.
"""

import contextlib
import io
import os
import sys
from functools import partial

from megatron_mtp.arguments import checkpoints, checks, defaults, errors, gpus, vocabulary
from megatron_mtp.data.embedded import corpus_prefix, default_cache_dir
from megatron_mtp.data.indexed import DatasetError


def parse():
    """Megatron-LM's parsed and validated arguments with this script's defaults; None (after
    one error line) if they are refused."""
    with errors.reporting_rank_finishes_its_checks():
        return _parse()


def _parse():
    from megatron_mtp.patched_core import PatchedCoreError, require_patched_core

    try:
        require_patched_core()
    except PatchedCoreError as error:
        errors.fail(error)
        return None
    import torch
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from megatron.core.fork.upstream_fixes import checkpoint_files

    on_cpu = not torch.cuda.is_available()
    unusable = gpus.unusable_gpus() if on_cpu else None
    if unusable:
        errors.fail(unusable)
        return None
    if on_cpu:
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron-LM's TP check; moot on CPU
    embedded = not any(defaults.given(flag) for flag in defaults.DATA_FLAGS)
    # argparse's own errors (an unknown flag, a bad value) print usage and exit: on rank 0 only.
    quiet = contextlib.redirect_stderr(io.StringIO()) if os.environ.get("RANK", "0") != "0" \
        else contextlib.nullcontext()
    try:
        with quiet:
            chosen = defaults.initial(on_cpu, embedded)
            args = parse_args(defaults.provider(chosen))
            vocabulary.from_data(args, chosen, embedded)
            checks.schedule_plan(args)
            defaults.from_first_parse(chosen, args, on_cpu, embedded)
            args = parse_args(defaults.provider(chosen))
        checks.check(args)
        checkpoints.check_load(args)
        deferred = gpus.capability_deferred(args)
        with quiet, _without_argument("--moe-grouped-gemm") if deferred else contextlib.nullcontext(), \
                _without_writers() if args.dry_run or checkpoints.finished(args) else contextlib.nullcontext(), \
                _checked_before_anything_is_written(partial(_check_config, deferred=deferred), checkpoints.check):
            args = parse_and_validate_args(defaults.provider(chosen))
        if embedded and not args.dry_run:
            corpus_prefix(default_cache_dir())
        return args
    except (errors.ArgumentError, DatasetError, checkpoint_files.CheckpointError, AssertionError, ValueError,
            TypeError) as error:
        errors.fail(error)
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


@contextlib.contextmanager
def _without_writers():
    """Megatron-LM's global setup without its TensorBoard and W&B writers, which create their
    directories and an events file: a dry run, or a rerun of a checkpoints.finished run, writes nothing."""
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
