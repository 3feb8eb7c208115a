"""GPU path: Transformer Engine layers, bf16 and NCCL. Skipped on CPU-only machines."""

import pytest

from tests.harness import launch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_bf16_training_step_on_gpu_matches_the_sdpa_spec():
    (result,) = launch("tests.bodies.gpu:bf16_steps", 1, {}, timeout=600, use_gpus=True)
    assert result["device"] == "cuda"
    assert result["current_device"] == ["int", True]  # upstream's value, not a torch.device
    for step in result["local"]:
        assert step["lm loss"] == step["lm loss"] and step["grad norm"] > 0
    if result["transformer_engine"] is not None:
        for te, local in zip(result["transformer_engine"], result["local"], strict=True):
            assert abs(te["lm loss"] - local["lm loss"]) / local["lm loss"] < 5e-2
