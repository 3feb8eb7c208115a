# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A synchronous dist-checkpoint save keeps its write results in the saving process: no
multiprocessing Manager (a "spawn" interpreter that imports torch, about 3 s per rank at
a process's first save) is started, and the checkpoint loads back bit for bit."""

import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async


@pytest.fixture
def world_of_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_synchronous_save_starts_no_manager_process(world_of_one, tmp_path):
    weight = torch.arange(12.0).reshape(3, 4)
    dist_checkpointing.save({"weight": ShardedTensor.from_rank_offsets("weight", weight)}, str(tmp_path))
    assert filesystem_async._results_queue is None  # upstream's Manager queue was never made
    assert multiprocessing.active_children() == []
    loaded = dist_checkpointing.load({"weight": ShardedTensor.from_rank_offsets("weight", torch.zeros(3, 4))},
                                     str(tmp_path))
    assert torch.equal(loaded["weight"], weight)
