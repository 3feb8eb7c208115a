# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Per-depth MTP metrics of megatron.training's loop: console, TensorBoard and W&B (spec 7).

Each step hands its exactly reduced per-depth sums (objective, valid, correct, chain-correct,
sampled and greedy-draft acceptances and their chains; megatron.core.fork.mtp.statistics) to
``record_step``. The
console line and the TensorBoard/W&B scalars of a log interval are ratios of the interval's
sums (token-weighted over all its steps, not a mean of per-step ratios): ``mtp_k loss``,
``mtp_k acceptance``, ``mtp_k chain acceptance``, ``mtp_k sampled acceptance``, ``mtp_k
greedy-draft acceptance``, ``expected accepted length (incl. bonus token)`` and its
``(sampling)`` and ``(greedy drafts)`` forms, plus ``mtp grad norm``, tokens/s and the ETA. The
sampled and greedy-draft ones are ratios over the positions where they were measured: under
``ce`` only a step that training_log prints measures them (training_loop.exact_step.logged), so
a line's are its own iteration's step's; a draft objective measures them in every step. The
sums since the start of training (the cumulative acceptance) and those of the open interval are
part of the checkpoint (``state_dict``), so they continue across a resume.
"""

import time

import torch

from megatron.core.fork.mtp.statistics import (
    EXPECTED_LENGTH,
    EXPECTED_LENGTH_GREEDY,
    EXPECTED_LENGTH_SAMPLING,
    metrics_from_sums,
    widened,
)

ROUTER_LOSS_SUFFIXES = ("load balancing loss", "z loss")


class _Tracker:
    def __init__(self):
        self.interval = None  # [D, FIELDS] sums since the last log line
        self.cumulative = None  # [D, FIELDS] sums since the start of training (checkpointed)
        self.tokens = 0
        self.mtp_grad_norms = []
        self.router = {}  # "mtp_k <router loss>" -> sum of step values since the last log line
        self.router_steps = 0
        self.interval_start = time.perf_counter()
        self.iterations = 0

    def record(self, counts, sums, mtp_grad_norm, router=None) -> None:
        if sums is not None:
            sums = sums.detach().double().cpu()
            self.interval = sums.clone() if self.interval is None else self.interval + sums
            self.cumulative = sums.clone() if self.cumulative is None else self.cumulative + sums
        if counts is not None:
            self.tokens += counts.tokens
        if mtp_grad_norm is not None:
            self.mtp_grad_norms.append(float(mtp_grad_norm))
        if router:
            self.router = {name: self.router.get(name, 0.0) + value for name, value in router.items()}
            self.router_steps += 1
        self.iterations += 1

    def text(self, iteration: int, train_iters: int | None, writer=None, wandb_writer=None,
             close_interval: bool = True) -> str:
        """The log interval's console text. Closing the interval writes its scalars and starts
        the next one; upstream's extra line after the first iteration of a run leaves it open."""
        seconds = time.perf_counter() - self.interval_start
        values = {}
        if self.interval is not None:
            values.update(metrics_from_sums(self.interval))
            for name, value in metrics_from_sums(self.cumulative).items():
                if "acceptance" in name or name in (EXPECTED_LENGTH, EXPECTED_LENGTH_SAMPLING, EXPECTED_LENGTH_GREEDY):
                    values[f"{name} (cumulative)"] = value
        values.update({name: total / self.router_steps for name, total in self.router.items()})
        if self.mtp_grad_norms:
            values["mtp grad norm"] = self.mtp_grad_norms[-1]
        if self.tokens and seconds > 0:
            values["tokens per second"] = self.tokens / seconds
        text = _console(values, self.interval.size(0) if self.interval is not None else 0)
        if self.iterations and train_iters:
            remaining = (train_iters - iteration) * seconds / self.iterations
            text += f" ETA: {time.strftime('%H:%M:%S', time.gmtime(max(remaining, 0)))} |"
        if close_interval:
            _write(values, iteration, writer, wandb_writer)
            self.interval, self.tokens, self.mtp_grad_norms, self.iterations = None, 0, [], 0
            self.router, self.router_steps = {}, 0
            self.interval_start = time.perf_counter()
        return text


def _console(values: dict, depths: int) -> str:
    text = ""
    for k in range(1, depths + 1):
        text += (f" mtp_{k} loss: {values[f'mtp_{k} loss']:.6E} | mtp_{k} acceptance:"
                 f" {values[f'mtp_{k} acceptance']:.4f} | mtp_{k} chain acceptance:"
                 f" {values[f'mtp_{k} chain acceptance']:.4f} |")
        if f"mtp_{k} sampled acceptance" in values:
            text += f" mtp_{k} sampled acceptance: {values[f'mtp_{k} sampled acceptance']:.4f} |"
        if f"mtp_{k} greedy-draft acceptance" in values:
            text += f" mtp_{k} greedy-draft acceptance: {values[f'mtp_{k} greedy-draft acceptance']:.4f} |"
    if depths:
        text += f" {EXPECTED_LENGTH}: {values[EXPECTED_LENGTH]:.4f} |"
        if EXPECTED_LENGTH_SAMPLING in values:
            text += f" {EXPECTED_LENGTH_SAMPLING}: {values[EXPECTED_LENGTH_SAMPLING]:.4f} |"
        if EXPECTED_LENGTH_GREEDY in values:
            text += f" {EXPECTED_LENGTH_GREEDY}: {values[EXPECTED_LENGTH_GREEDY]:.4f} |"
    for k in range(1, depths + 1):  # each depth's router losses (MoE), as step values
        text += "".join(f" {name}: {value:.6E} |" for name, value in values.items()
                        if name.startswith(f"mtp_{k} ") and name.endswith(ROUTER_LOSS_SUFFIXES))
    if "mtp grad norm" in values:
        text += f" mtp grad norm: {values['mtp grad norm']:.3f} |"
    if "tokens per second" in values:
        text += f" tokens/s: {values['tokens per second']:.1f} |"
    return text


def _write(values: dict, iteration: int, writer, wandb_writer, suffix: str = "") -> None:
    scalars = {f"{name}{suffix}": value for name, value in values.items() if not name.endswith(" tokens")}
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(scalars, iteration)


_TRACKER = _Tracker()


def record_step(counts, sums, mtp_grad_norm, router=None) -> None:
    """One step's global counts (or None), its reduced MTP sums [D, FIELDS] (or None), the
    MTP group's gradient norm (or None) and its MTP depths' router losses (or None)."""
    _TRACKER.record(counts, sums, mtp_grad_norm, router)


def log_string(iteration: int, train_iters: int | None, writer=None, wandb_writer=None,
               close_interval: bool = True) -> str:
    """Console text of the interval since it was last closed; closing it writes its scalars."""
    return _TRACKER.text(iteration, train_iters, writer, wandb_writer, close_interval)


def evaluation_string(sums, iteration: int, writer=None, wandb_writer=None, suffix: str = "",
                      router: dict | None = None) -> str:
    """Console text and scalars of an evaluation: its reduced MTP sums (None without MTP) and
    its router losses (``{name: value}``: the backbone's as upstream names them, each MTP
    depth's as ``mtp_k ...``)."""
    router = router or {}
    values = metrics_from_sums(sums.detach().double().cpu()) if sums is not None else {}
    values.update(router)
    _write(values, iteration, writer, wandb_writer, suffix=f" validation{suffix}")
    backbone = "".join(f" {name}: {value:.6E} |" for name, value in router.items() if not name.startswith("mtp_"))
    return _console(values, sums.size(0) if sums is not None else 0) + backbone


def state_dict() -> dict:
    """The counters that span steps, for the checkpoint: the sums since the start of training
    and those of the open log interval (a run resumed mid-interval logs what the
    uninterrupted run logs)."""
    state = {name: None if sums is None else sums.tolist()
             for name, sums in (("cumulative_sums", _TRACKER.cumulative), ("interval_sums", _TRACKER.interval))}
    state["interval_router_losses"] = [dict(_TRACKER.router), _TRACKER.router_steps]
    return state


def load_state_dict(state: dict | None) -> None:
    def tensor(name):
        sums = (state or {}).get(name)
        return None if sums is None else widened(torch.tensor(sums, dtype=torch.float64))

    _TRACKER.cumulative, _TRACKER.interval = tensor("cumulative_sums"), tensor("interval_sums")
    router, steps = (state or {}).get("interval_router_losses") or ({}, 0)
    _TRACKER.router, _TRACKER.router_steps = dict(router), steps
