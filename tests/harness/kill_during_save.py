# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py, with rank 0 killed (SIGKILL) in the middle of one save.

KILL_AT_ITERATION names the save; KILL_DURING_SAVE the moment:
- after-tensor-files: every rank has written its tensor files, nothing names them yet;
- replacing-tracker: the new tracker text is written to its temporary file, not renamed.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

ITERATION = int(os.environ["KILL_AT_ITERATION"])
MOMENT = os.environ["KILL_DURING_SAVE"]


def die() -> None:
    print(f"killed during the save of iteration {ITERATION} ({MOMENT})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def install() -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron.core.fork.upstream_fixes import checkpoint_files

    if MOMENT == "after-tensor-files":
        save = dist_checkpointing.save

        def save_then_die(state, directory, *args, **kwargs):
            result = save(state, directory, *args, **kwargs)
            if f"iter_{ITERATION:07d}" in str(directory):
                dist.barrier()  # every rank's files are on disk
                if dist.get_rank() == 0:
                    die()
            return result

        dist_checkpointing.save = save_then_die
    elif MOMENT == "replacing-tracker":
        class Os:
            def __getattr__(self, name):
                return getattr(os, name)

            def replace(self, source, target):
                if str(target).endswith(checkpoint_files.TRACKER) and open(source).read() == str(ITERATION):
                    die()
                os.replace(source, target)

        checkpoint_files.os = Os()
    else:
        raise SystemExit(f"unknown KILL_DURING_SAVE {MOMENT!r}")


install()
sys.argv[0] = str(REPO_ROOT / "pretrain_gpt_mtp.py")
runpy.run_path(sys.argv[0], run_name="__main__")
