# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Run pretrain_gpt_mtp.py's argument handling on many command lines in one process.

    python -m tests.harness.argument_cases < cases.json > results.json

Each case is {"argv": [...], "env": {...}}; each result says whether the arguments were
accepted, what the script printed on stderr, and its output (stdout and stderr) in order.
Parsing needs no distributed start-up, so one process checks every refusal (a real launch
per case would cost seconds each).
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
    stderr, output = io.StringIO(), io.StringIO()  # output: stdout and stderr in the order written
    try:
        with contextlib.redirect_stderr(_Both(stderr, output)), contextlib.redirect_stdout(output):
            accepted = arguments.parse() is not None
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        from megatron.training.global_vars import unset_global_variables

        unset_global_variables()  # a case refused after Megatron-LM's validation set them
    def lines(text: io.StringIO) -> list[str]:
        return [line for line in text.getvalue().splitlines() if line.strip() and "warn" not in line.lower()]
    return {"accepted": accepted, "stderr": lines(stderr), "output": lines(output)}


class _Both(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)


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
