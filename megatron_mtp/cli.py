# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The tools' one-line errors: `PROG: error: <message on one line>` on stderr, then an exit status.

One format for tools/convert_checkpoint.py, tools/eval_speculative.py and tools/plot_runs.py
(pretrain_gpt_mtp.py says its own in megatron_mtp.arguments, with flag hints and from one rank).
"""

import sys


def fail(prog: str, message, status: int = 2) -> int:
    """Print `message` (whitespace folded into one line) as `prog`'s error; return `status`."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return status
