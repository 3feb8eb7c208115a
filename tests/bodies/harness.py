# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Bodies that exercise the launcher itself (tests/test_harness.py)."""

import os
import time

import torch.distributed as dist


def identity() -> dict:
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
            "session_leader": os.getsid(0) == os.getpid(), "rank_env": os.environ["RANK"]}


def fail_on(rank: int) -> None:
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} fails on purpose")
    dist.barrier()  # the others wait for it, as ranks of a real body would


def hang(pid_dir: str) -> None:
    with open(os.path.join(pid_dir, str(dist.get_rank())), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
