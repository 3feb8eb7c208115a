# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""One rank of a launch: bring up gloo, run the body, write its result or traceback as JSON."""

import datetime
import importlib
import json
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")  # megatron-core warns at import about missing GPU extensions


def main(spec_path: str, result_path: str) -> int:
    import os

    import torch
    import torch.distributed as dist

    spec = json.loads(open(spec_path).read())
    outcome = {"ok": False}
    try:
        backend = "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            backend = "nccl"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
        if spec["build"] is not None:
            from megatron_mtp.patched_core import require_patched_core

            require_patched_core(spec["build"])
        module_name, function_name = spec["body"].split(":")
        body = getattr(importlib.import_module(module_name), function_name)
        outcome = {"ok": True, "result": body(**spec["args"])}
    except BaseException:
        outcome = {"ok": False, "traceback": traceback.format_exc()}
    with open(result_path, "w") as f:
        json.dump(outcome, f)
    if outcome["ok"] and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
