# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A synchronous checkpoint save collects its write results in the saving process.

megatron-core's file writer returns each rank's write results through a queue that crosses
processes, for asynchronous saves run by another process. It makes that queue with a
multiprocessing Manager: a helper interpreter started with "spawn", which re-imports the
entry script and imports torch to unpickle the results (about 3 s per rank at a process's
first save, measured on CPU here). A save that runs in the calling process
(`dist_checkpointing.save` without async, every save of Megatron-LM's loop without
--async-save) writes with threads only and needs a plain thread-safe queue.
"""

import contextlib
import queue
import threading

_state = threading.local()


@contextlib.contextmanager
def synchronous_save():
    """While a save is prepared to run in this process."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


def write_results_queue():
    """An in-process queue while `synchronous_save` is active, else None (upstream's own)."""
    return queue.Queue() if getattr(_state, "active", False) else None
