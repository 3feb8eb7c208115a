# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""What a training run left behind, read back as numbers: its console log or its TensorBoard events.

One reader for the tools that draw runs (tools/plot_runs.py), the experiments and the tests.
A run is a console log (what ``torchrun ... pretrain_gpt_mtp.py`` printed, with or without
torchrun's ``[defaultN]:`` prefixes) or a directory holding TensorBoard event files (the
trainer's ``--tensorboard-dir``). Either way it becomes ``Run.series``: ``{name: {iteration:
value}}`` under the console's names (``lm loss``, ``mtp_k loss``, ``mtp_k acceptance``, ``mtp_k
chain acceptance``, ``expected accepted length (incl. bonus token)``, ``grad norm``, ``mtp grad
norm``, ``learning rate``, ``elapsed time per iteration (ms)``; validation values as ``<name>
validation``), and ``Run.tokens``: the tokens consumed by the end of each logged iteration
(consumed samples x sequence length, so a batch-size ramp is counted as it happened).

The two sources log at their own intervals: the console every ``--log-interval`` iterations,
with the interval's values (MTP metrics token-weighted over the interval; upstream's lm loss
averaged over its iterations); TensorBoard every ``--tensorboard-log-interval`` (upstream's
losses of that iteration; the MTP metrics of the console's interval).
"""

import bisect
import re
from dataclasses import dataclass, field
from pathlib import Path

ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ \|(.*)$")
# The end-of-run evaluation prints "... at iteration N on validation set |"; read last, it wins
# at N, as its TensorBoard values (written after the in-loop ones at the same step) do.
VALIDATION = re.compile(r"validation.* loss at iteration (\d+)(?: on \w+ set)? \|(.*)$")
SEQ_LENGTH = re.compile(r"^(?:\[default\d+\]:)?\s+seq_length \.+ (\d+)\s*$", re.MULTILINE)
# The trainer's console and TensorBoard name (megatron.core.fork.training_loop.metrics.EXPECTED_LENGTH,
# not imported: reading a run needs neither torch nor megatron).
EXPECTED_LENGTH_NAME = "expected accepted length (incl. bonus token)"
SAMPLING_LENGTH_NAME = "expected accepted length (sampling)"  # ...statistics.EXPECTED_LENGTH_SAMPLING
GREEDY_LENGTH_NAME = "expected accepted length (greedy drafts)"  # ...statistics.EXPECTED_LENGTH_GREEDY
# TensorBoard tags that upstream spells otherwise than its console line.
TENSORBOARD_NAMES = {"grad-norm": "grad norm", "learning-rate": "learning rate"}


class RunError(ValueError):
    pass


@dataclass
class Run:
    name: str
    series: dict = field(default_factory=dict)  # name -> {iteration: value}
    tokens: dict = field(default_factory=dict)  # iteration -> tokens consumed by its end

    def depths(self) -> int:
        return sum(1 for name in self.series if re.fullmatch(r"mtp_\d+ loss", name))

    def iterations(self) -> list[int]:
        """Every iteration some series was logged at."""
        return sorted(set().union(*self.series.values())) if self.series else []

    def last(self, name: str) -> float | None:
        values = self.series.get(name)
        return values[max(values)] if values else None


def console_fields(text: str) -> dict:
    """``name: value |`` fields of a console line, as floats (validation's ``... value`` without it)."""
    values = {}
    # Fields end with "|"; what follows the last one is another print that lost its line break.
    for part in text.rsplit("|", 1)[0].split("|"):
        name, sep, value = part.rpartition(":")
        if not sep:
            continue
        name = name.strip()
        if name.endswith(" value"):  # validation lines: "lm loss value: ..."
            name = name[: -len(" value")]
        try:
            values[name] = float(value.strip())
        except ValueError:
            pass
    return values


def parse_console(output: str) -> tuple[dict, dict]:
    """The iteration and validation lines of a console log: ``{iteration: {name: value}}`` each."""
    iterations, validations = {}, {}
    for line in output.splitlines():
        if match := ITERATION.search(line):
            iterations[int(match.group(1))] = console_fields(match.group(2))
        elif match := VALIDATION.search(line):
            validations[int(match.group(1))] = console_fields(match.group(2))
    return iterations, validations


def _events(logdir: Path):
    """The TensorBoard events of the one run in `logdir` (its event files there, or in one
    subdirectory), loaded once: (multiplexer, that run's name or None); several runs are refused."""
    try:
        from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    except ImportError:
        raise RunError("reading TensorBoard events needs the tensorboard package (the plot extra)") from None
    multiplexer = EventMultiplexer(size_guidance={"scalars": 0, "tensors": 0})
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    runs = sorted(run for run, tags in multiplexer.Runs().items() if tags["scalars"])
    if len(runs) > 1:
        raise RunError(f"{logdir}: holds the events of {len(runs)} runs ({', '.join(runs)}): give each "
                       f"run's own directory")
    return multiplexer, (runs[0] if runs else None)


def _scalars(multiplexer, run) -> dict:
    if run is None:
        return {}
    return {tag: {event.step: event.value for event in multiplexer.Scalars(run, tag)}
            for tag in multiplexer.Runs()[run]["scalars"]}


def _text(multiplexer, run, tag: str) -> str | None:
    """The last value of a text summary of the run (upstream writes every argument as one)."""
    from tensorboard.util import tensor_util

    if run is None or f"{tag}/text_summary" not in multiplexer.Runs()[run]["tensors"]:
        return None
    event = multiplexer.Tensors(run, f"{tag}/text_summary")[-1]
    return tensor_util.make_ndarray(event.tensor_proto).item().decode()


def _from_console(path: Path, name: str) -> Run:
    try:
        text = path.read_text(errors="replace")
    except OSError as error:
        raise RunError(f"{path}: {error.strerror or error}") from None
    iterations, validations = parse_console(text)
    if not iterations:
        raise RunError(f"{path}: no iteration lines of pretrain_gpt_mtp.py in this log")
    seq_length = SEQ_LENGTH.search(text)
    run = Run(name)
    for iteration, values in sorted(iterations.items()):
        for key, value in values.items():
            run.series.setdefault(key, {})[iteration] = value
        if seq_length and "consumed samples" in values:
            run.tokens[iteration] = values["consumed samples"] * int(seq_length.group(1))
    for iteration, values in sorted(validations.items()):
        for key, value in values.items():
            run.series.setdefault(f"{key} validation", {})[iteration] = value
    return run


def _from_tensorboard(path: Path, name: str) -> Run:
    multiplexer, events_run = _events(path)
    scalars = _scalars(multiplexer, events_run)
    if "lm loss" not in scalars:
        raise RunError(f"{path}: no 'lm loss' scalars in these TensorBoard events")
    run = Run(name)
    for tag, values in scalars.items():
        if tag.endswith((" vs samples", " ppl")) or tag == "iteration-time":
            continue
        run.series[TENSORBOARD_NAMES.get(tag, tag)] = dict(sorted(values.items()))
    if "iteration-time" in scalars:  # upstream writes seconds; the console prints milliseconds
        run.series["elapsed time per iteration (ms)"] = {
            step: seconds * 1000.0 for step, seconds in sorted(scalars["iteration-time"].items())}
    # Upstream writes 'batch-size' at the iteration and 'batch-size vs samples' at the consumed
    # samples in the same call: the two step lists pair up in order.
    steps, samples = sorted(scalars.get("batch-size", {})), sorted(scalars.get("batch-size vs samples", {}))
    seq_length = _text(multiplexer, events_run, "seq_length")
    if seq_length is not None and not seq_length.isdigit():
        raise RunError(f"{path}: its seq_length text summary is {seq_length!r}, not a number")
    if seq_length and len(steps) == len(samples) and steps:
        known = {step: sample * int(seq_length) for step, sample in zip(steps, samples)}
        run.tokens = _between(known, run.iterations())
    return run


def _between(known: dict, steps: list) -> dict:
    """Tokens at every logged step inside the known ones (TensorBoard writes them every
    --tensorboard-log-interval, the MTP metrics every --log-interval): linear between the two
    known neighbours, exact while the batch size is constant between them."""
    points = sorted(known)
    tokens = {}
    for step in steps:
        if step in known:
            tokens[step] = known[step]
        elif points[0] < step < points[-1]:
            index = bisect.bisect(points, step)
            before, after = points[index - 1], points[index]
            tokens[step] = known[before] + (known[after] - known[before]) * (step - before) / (after - before)
    return tokens


def read(path: str | Path, name: str | None = None) -> Run:
    """A run from its console log file or its TensorBoard directory; refused in one line otherwise."""
    path = Path(path)
    # a trainer's --tensorboard-dir is often RUN/tensorboard: the run's name is RUN
    name = name or (path.stem if path.is_file() else path.resolve().parent.name if path.name == "tensorboard"
                    else path.name)
    if path.is_file():
        return _from_console(path, name)
    if path.is_dir():
        if not any(path.rglob("events.out.tfevents.*")):
            raise RunError(f"{path}: a directory without TensorBoard event files (give the trainer's "
                           f"--tensorboard-dir, or its console log)")
        return _from_tensorboard(path, name)
    raise RunError(f"{path}: no such file or directory")
