# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Detached MTP heads draw their random numbers from streams of their own (``mtp_detach_heads``).

Without this, the MTP block's initialization and its dropout consume the backbone's streams: the
default generator of the compute device (hidden dropout, and initialization on CPU) and the RNG
tracker's named states (tensor-parallel initialization and attention dropout on GPUs, expert
parallelism's). A run with detached heads then trains its backbone on other dropout masks, and
in a pipeline's last stage on other initial weights, than the same run without MTP, although no
gradient reaches the backbone from the heads.

``own_streams(config)`` swaps every one of those streams for an MTP stream of the same kind while
the MTP block is built or run, and swaps back after: the backbone's streams are left exactly where
they were (the models' builders use its form ``swapped_in``, left by ``close()``). The MTP streams
live in the RNG tracker under ``mtp/<name>`` (``mtp/default`` for the device's default generator,
``mtp/cpu`` for the CPU generator on a CUDA machine), so Megatron-LM's checkpoints save and
restore them with the tracker's states and a resumed run draws what the uninterrupted one drew.
Each starts, when the block is built, from a hash of the backbone stream it stands beside
(without advancing that stream): as reproducible as the backbone's seeds, different per
tensor-parallel or expert rank where those are.

Activation recompute of an MTP layer restores the tracker states and default generator it saw in
the forward (which were the MTP streams), so the recomputed dropout masks are the forward's.
Heads that are not detached share the backbone's gradients anyway; they keep upstream's streams.
"""

import contextlib
import hashlib

import torch

from megatron.core.fork.runtime import device as compute_device

PREFIX = "mtp/"
DEFAULT = "default"  # the compute device's default generator
CPU = "cpu"  # torch's CPU generator, on a CUDA machine (CPU initialization draws from it)


def _generators() -> dict:
    """name -> (get state, set state, device) of the generators outside the tracker."""
    generators = {DEFAULT: (compute_device.get_rng_state, compute_device.set_rng_state, compute_device.device_type())}
    if compute_device.cuda_available():
        generators[CPU] = (torch.get_rng_state, torch.set_rng_state, "cpu")
    return generators


def _beside(state: torch.Tensor, name: str, device: str) -> torch.Tensor:
    """A generator state seeded from a hash of `state` (which stays as it is)."""
    digest = hashlib.sha256(state.cpu().numpy().tobytes() + (PREFIX + name).encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator.get_state()


# The MTP streams where no RNG tracker is seeded (a model built outside Megatron-LM's
# initialization, as in unit tests): kept here instead of in the tracker's states.
_untracked: dict = {}


def _tracker():
    """Megatron's RNG tracker when it has states (seeded by model_parallel_cuda_manual_seed)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    return tracker if tracker.is_initialized() else None


@contextlib.contextmanager
def own_streams(config, only_if: bool = True, start: bool = False):
    """Within: the MTP block's streams in place of the backbone's (with ``mtp_detach_heads``, and
    `only_if`: an MTP stage's own embedding copy, say). `start` (building the block): the MTP
    streams start anew beside the backbone's, so a model built again after the same seeding is
    the same model, as the backbone's streams make it."""
    if not (only_if and getattr(config, "mtp_detach_heads", False)):
        yield
        return
    tracker = _tracker()
    states = tracker.get_states() if tracker is not None else dict(_untracked)
    generators = _generators()
    backbone = {name: get() for name, (get, _, _) in generators.items()}
    tracked = [name for name in states if not name.startswith(PREFIX)]
    device = compute_device.device_type()
    # Created when the block is built (and on first use after a checkpoint from before they
    # existed); a checkpoint that has them restores them after the build.
    begun = {**{name: (states[name], device) for name in tracked},
             **{name: (backbone[name], kind) for name, (_, _, kind) in generators.items()}}
    for name, (beside, kind) in begun.items():
        if start or PREFIX + name not in states:
            states[PREFIX + name] = _beside(beside, name, kind)
    swapped = dict(states)
    for name in tracked:
        swapped[name], swapped[PREFIX + name] = states[PREFIX + name], states[name]
    if tracker is not None:
        tracker.set_states(swapped)
    for name, (_, set_state, _) in generators.items():
        set_state(states[PREFIX + name])
    try:
        yield
    finally:
        inside = tracker.get_states() if tracker is not None else swapped
        restored = dict(inside)
        for name in tracked:
            restored[PREFIX + name], restored[name] = inside[name], inside[PREFIX + name]
        for name, (get, set_state, _) in generators.items():
            restored[PREFIX + name] = get()
            set_state(backbone[name])
        if tracker is not None:
            tracker.set_states(restored)
        else:
            _untracked.update(restored)


def swapped_in(config, only_if: bool = True, start: bool = False) -> contextlib.ExitStack:
    """``own_streams`` entered now and left by the returned stack's ``close()``: for a hook that
    runs upstream's lines inside it without re-indenting them (a ``with`` block would rewrite every
    line of an upstream call, which each release changes)."""
    stack = contextlib.ExitStack()
    stack.enter_context(own_streams(config, only_if=only_if, start=start))
    return stack
