# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""torchrun, with one exit status of its own: a run that a signal to the launcher stopped exits 0
when every worker then exited 0.

    python -m megatron_mtp.launch --nproc-per-node 2 pretrain_gpt_mtp.py [ARGS]   # torchrun's flags

torchrun (torch.distributed.run, run here unchanged) passes a SIGTERM or SIGINT it receives on
to its workers, waits for them (--shutdown-timeout, 30 s by default; then SIGKILL) and exits 1
with its SignalException, whatever they did. pretrain_gpt_mtp.py's workers save a checkpoint on
that signal (--exit-signal-handler) and exit 0: a preempted or interrupted run that kept its work
then exits 0 here, so that a scheduler or a script sees it as stopped, not failed. A worker that
failed or was killed keeps torchrun's status.
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing import api as processes
from torch.distributed.run import main as torchrun


def main() -> int:
    exits = []  # the workers' statuses once torchrun has closed them
    close = processes.SubprocessContext._close

    def recording_close(self, death_sig, timeout=30):
        close(self, death_sig, timeout)
        exits.extend(handler.proc.returncode for handler in self.subprocess_handlers.values())

    processes.SubprocessContext._close = recording_close
    try:
        torchrun()
    except processes.SignalException as stopped:
        if not exits or any(status != 0 for status in exits):
            raise
        print(f"megatron_mtp.launch: stopped by {signal.Signals(stopped.sigval).name}; every worker exited 0",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
