# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A torchrun worker for tests/test_harness.py: what a zygote's child sees and does.

    torchrun ... tests/bodies/torchrun_worker.py MODE PID_DIR
MODE: report (print argv, cwd, sys.path[0], RANK, the parent's program, stream check), exit3 (exit status 3),
sigterm (wait for SIGTERM, say so, exit 0), hang (sleep until killed). Every mode first
writes its pid to PID_DIR/RANK.
"""

import os
import signal
import sys
import time

mode, pid_dir = sys.argv[1], sys.argv[2]
with open(os.path.join(pid_dir, os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
if mode == "report":
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = "zygote" if b"zygote.py\0serve" in f.read() else "other"
    print(f"argv={sys.argv[1:]} cwd={os.getcwd()} path0={sys.path[0]} rank={os.environ['RANK']} "
          f"parent={parent}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
elif mode == "exit3":
    sys.exit(3)
elif mode == "sigterm":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(0)))
    print("waiting", flush=True)
    time.sleep(120)
    sys.exit(1)
elif mode == "hang":
    time.sleep(600)
