# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A run's console output kept in a file (--log-file), beside the terminal.

The rank that prints the iteration and validation lines (Megatron-LM's print_rank_last: the
last rank) appends what it writes to stdout and stderr to the file, which tools/plot_runs.py
reads like a console log.
"""

import os
import sys


class _Tee:
    def __init__(self, stream, file):
        self._stream, self._file = stream, file

    def write(self, text: str) -> int:
        self._file.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._file.flush()
        self._stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding...: the terminal's
        return getattr(self._stream, name)


def tee(path: str) -> None:
    """From now on, stdout and stderr also go to `path` (appended: a resumed run adds to it)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    file = open(path, "a", buffering=1)  # line-buffered: a killed run keeps its last lines
    sys.stdout, sys.stderr = _Tee(sys.stdout, file), _Tee(sys.stderr, file)
