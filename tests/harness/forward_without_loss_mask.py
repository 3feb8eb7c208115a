# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""pretrain_gpt_mtp.py whose forward step gives the model no loss mask on the ranks of
data-parallel rank MISSING_ON_DP_RANK (its loss function still reads the mask): the refusal
of an MTP forward without a loss mask inside a step, found on the last pipeline stage of
those ranks only."""

import os
import runpy
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.argv[0] = str(REPO_ROOT / "pretrain_gpt_mtp.py")
script = runpy.run_path(sys.argv[0], run_name="pretrain_gpt_mtp")


def install() -> None:
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    get_batch, loss_func = script["get_batch"], script["loss_func"]
    missing_on = int(os.environ.get("MISSING_ON_DP_RANK", "0"))

    def forward(data_iterator, model, return_schedule_plan: bool = False):
        tokens, labels, loss_mask, position_ids = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
        given = None if parallel_state.get_data_parallel_rank() == missing_on else loss_mask
        return model(tokens, position_ids, None, labels=labels, loss_mask=given), partial(loss_func, loss_mask)

    script["main"].__globals__["forward_step"] = forward


install()
sys.exit(script["main"]())
