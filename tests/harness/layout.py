"""Switch megatron-core's model-parallel layout inside a running launch."""

import contextlib

from megatron.core import parallel_state
from megatron_mtp.library.initialize import initialize_model_parallel


@contextlib.contextmanager
def model_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234, ep: int = 1):
    """The trainer's TP x PP (x VPP) x DP (x EP) setup for the body's block, torn down afterwards."""
    initialize_model_parallel(tp, pp, vpp, seed, ep)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
