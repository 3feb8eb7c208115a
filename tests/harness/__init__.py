"""Run a test body on N real gloo processes with a TP x PP x DP layout; see launcher.py."""

from tests.harness.launcher import DistributedTestFailure, launch

__all__ = ["launch", "DistributedTestFailure"]
