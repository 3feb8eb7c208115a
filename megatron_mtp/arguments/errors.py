# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""How a refused run says why: one line, from rank 0 (`fail`), with the flag to change named first
where Megatron-LM's own refusal names a config field or prints a bare assert (FLAG_HINTS)."""

import contextlib
import linecache
import os
import re
import signal
import sys
import threading


class ArgumentError(ValueError):
    pass


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
def reporting_rank_finishes_its_checks():
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
