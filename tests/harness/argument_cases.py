# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Run pretrain_gpt_mtp.py's argument handling on many command lines in one process.

    python -m tests.harness.argument_cases < cases.json > results.json

Each case is {"argv": [...], "env": {...}}; each result says whether the arguments were
accepted and what the script printed on stderr. Parsing needs no distributed start-up,
so one process checks every refusal (a real launch per case would cost seconds each).
"""

import contextlib
import io
import json
import os
import sys


def run(case: dict) -> dict:
    from megatron_mtp import arguments

    saved_env = dict(os.environ)
    os.environ.update(case.get("env", {}))
    sys.argv = ["pretrain_gpt_mtp.py", *case["argv"]]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            accepted = arguments.parse() is not None
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        from megatron.training.global_vars import unset_global_variables

        unset_global_variables()  # a case refused after Megatron-LM's validation set them
    lines = [line for line in stderr.getvalue().splitlines() if line.strip() and "warn" not in line.lower()]
    return {"accepted": accepted, "stderr": lines}


if __name__ == "__main__":
    print(json.dumps([run(case) for case in json.load(sys.stdin)]))


def check(cases: list[dict], timeout: int = 600) -> list[dict]:
    """`cases` through this module in one fresh process of this checkout's build (no CUDA): one
    outcome per case, each with `errors`, its `pretrain_gpt_mtp.py: error:` lines."""
    import subprocess

    from tests.harness.launcher import REPO_ROOT

    result = subprocess.run([sys.executable, "-m", "tests.harness.argument_cases"], input=json.dumps(cases),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                            env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    assert len(outcomes) == len(cases), (len(outcomes), len(cases))
    for outcome in outcomes:
        outcome["errors"] = [line for line in outcome["stderr"] if line.startswith("pretrain_gpt_mtp.py: error: ")]
    return outcomes
