# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""The context-parallel layout (megatron.core.fork.runtime.context_parallel.local_positions) against
indices written by hand: of every (padded) sequence, 2 x CP equal chunks, CP rank r holding
chunks r and 2 x CP - 1 - r (upstream's load balance). The data split, the MTP roll, the CP
attention's mask and, without Transformer Engine, upstream's get_batch_on_this_cp_rank all read
this one map, so the CP tests that compare them with each other (tests/test_context_parallel.py)
cannot see a wrong layout; this test can."""

import pytest
import torch

from megatron.core.fork.runtime.context_parallel import local_positions

# (total positions, CP, cu_seqlens_padded or None, the positions each CP rank holds)
LAYOUTS = [
    (8, 2, None, [[0, 1, 6, 7], [2, 3, 4, 5]]),
    (8, 4, None, [[0, 7], [1, 6], [2, 5], [3, 4]]),
    # packed sequences of 5, 3 and 1 tokens, each padded to a multiple of 2 x CP = 4: 8, 4, 4
    (16, 2, [0, 8, 12, 16], [[0, 1, 6, 7, 8, 11, 12, 15], [2, 3, 4, 5, 9, 10, 13, 14]]),
    # packed sequences of 5 and 9 tokens, each padded to a multiple of 2 x CP = 8: 8, 16
    (24, 4, [0, 8, 24], [[0, 7, 8, 9, 22, 23], [1, 6, 10, 11, 20, 21], [2, 5, 12, 13, 18, 19],
                         [3, 4, 14, 15, 16, 17]]),
]


@pytest.mark.parametrize("total, cp, padded, want", LAYOUTS)
def test_each_rank_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence(total, cp, padded, want):
    cu_seqlens = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    got = [local_positions(total, cp, rank, cu_seqlens).tolist() for rank in range(cp)]
    assert got == want


def test_a_sequence_not_padded_to_2cp_is_refused():
    with pytest.raises(ValueError, match="a sequence of 5 positions does not split into 2 x context_parallel_size = 4"):
        local_positions(9, 2, 0, torch.tensor([0, 5, 9], dtype=torch.int32))
