# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""tools/plot_runs.py and its reader (megatron_mtp.runs) on runs written by hand.

A console log as torchrun prints it (rank prefixes, upstream's argument dump, its first
iteration's line apart, a validation line) and TensorBoard events written with upstream's
tags and calls (``grad-norm``, ``learning-rate``, ``batch-size`` beside ``batch-size vs
samples``, ``iteration-time`` in seconds, the arguments as text): both read back under the
console's names, with tokens = consumed samples x sequence length counted by hand. The
trainer's own TensorBoard events are read in tests/test_detached_heads.py.
"""

import subprocess
import sys

import pytest

from megatron_mtp.runs import EXPECTED_LENGTH_NAME, GREEDY_LENGTH_NAME, SAMPLING_LENGTH_NAME, RunError, read
from tests.harness.launcher import REPO_ROOT

SEQ = 64
# Batch size ramps 4 -> 8: tokens are not iteration x batch.
CONSOLE = f"""\
[default0]:------------------------ arguments ------------------------
[default0]:  seq_length ...................................... {SEQ}
[default0]:  seed ............................................ 1234
[default1]: [2026-12-03 10:00:00.000000] iteration        1/       4 | consumed samples:            4 | \
elapsed time per iteration (ms): 900.0 | learning rate: 1.000000E-03 | global batch size:     4 | \
lm loss: 4.000000E+00 | mtp_1 loss: 4.500000E+00 | mtp_1 acceptance: 0.1000 | mtp_1 chain acceptance: \
0.1000 | mtp_2 loss: 4.600000E+00 | mtp_2 acceptance: 0.0500 | mtp_2 chain acceptance: 0.0200 | \
{EXPECTED_LENGTH_NAME}: 1.1200 | mtp grad norm: 0.500 | grad norm: 2.000 | number of skipped iterations:   0 |
[default1]: [2026-12-03 10:00:01.000000] iteration        4/       4 | consumed samples:           28 | \
elapsed time per iteration (ms): 100.0 | learning rate: 5.000000E-04 | global batch size:     8 | \
lm loss: 3.000000E+00 | mtp_1 loss: 3.500000E+00 | mtp_1 acceptance: 0.3000 | mtp_1 chain acceptance: \
0.3000 | mtp_2 loss: 3.600000E+00 | mtp_2 acceptance: 0.2000 | mtp_2 chain acceptance: 0.1000 | \
mtp_2 sampled acceptance: 0.1500 | mtp_2 greedy-draft acceptance: 0.1200 | {EXPECTED_LENGTH_NAME}: 1.4000 | \
{SAMPLING_LENGTH_NAME}: 1.3500 | {GREEDY_LENGTH_NAME}: 1.2500 | mtp grad norm: 0.250 | grad norm: 1.000 | \
number of skipped iterations:   0 |
[default1]: validation loss at iteration 4 | lm loss value: 3.100000E+00 | lm loss PPL: 2.219795E+01 | \
mtp_1 loss: 3.700000E+00 | mtp_1 acceptance: 0.2500 |
[default1]: validation loss at iteration 4 on validation set | lm loss value: 3.050000E+00 | lm loss PPL: \
2.111700E+01 | mtp_1 loss: 3.650000E+00 | mtp_1 acceptance: 0.2600 |
"""


def plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/plot_runs.py", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def console(tmp_path):
    path = tmp_path / "attached.log"
    path.write_text(CONSOLE)
    return path


@pytest.fixture
def tensorboard(tmp_path):
    """Upstream's calls for two logged iterations, without MTP (training_log, write_args_to_tensorboard)."""
    from torch.utils.tensorboard import SummaryWriter

    logdir = tmp_path / "no_mtp"
    writer = SummaryWriter(str(logdir))
    writer.add_text("seq_length", str(SEQ), global_step=0)
    for iteration, samples, batch, loss, seconds in ((1, 4, 4, 4.25, 0.9), (4, 28, 8, 3.25, 0.1)):
        writer.add_scalar("learning-rate", 1e-3, iteration)
        writer.add_scalar("learning-rate vs samples", 1e-3, samples)
        writer.add_scalar("batch-size", batch, iteration)
        writer.add_scalar("batch-size vs samples", batch, samples)
        writer.add_scalar("lm loss", loss, iteration)
        writer.add_scalar("lm loss vs samples", loss, samples)
        writer.add_scalar("grad-norm", 2.0, iteration)
        writer.add_scalar("iteration-time", seconds, iteration)
    writer.add_scalar("lm loss validation", 3.5, 4)
    writer.close()
    return logdir


def test_a_console_log_reads_back_under_its_own_names(console):
    run = read(console)
    assert run.name == "attached" and run.depths() == 2
    assert run.series["lm loss"] == {1: 4.0, 4: 3.0}
    assert run.series["mtp_2 chain acceptance"] == {1: 0.02, 4: 0.1}
    assert run.series[EXPECTED_LENGTH_NAME] == {1: 1.12, 4: 1.4}
    assert run.series["mtp_2 sampled acceptance"] == {4: 0.15} and run.series[SAMPLING_LENGTH_NAME] == {4: 1.35}
    assert run.series["mtp_2 greedy-draft acceptance"] == {4: 0.12} and run.series[GREEDY_LENGTH_NAME] == {4: 1.25}
    assert run.series["mtp grad norm"] == {1: 0.5, 4: 0.25}
    assert run.series["learning rate"] == {1: 1e-3, 4: 5e-4}
    # the end-of-run evaluation at iteration 4 wins, as its TensorBoard values (written last) do
    assert run.series["lm loss validation"] == {4: 3.05} and run.series["mtp_1 acceptance validation"] == {4: 0.26}
    assert run.tokens == {1: 4 * SEQ, 4: 28 * SEQ}


def test_tensorboard_events_read_back_under_the_console_names(tensorboard):
    named = tensorboard.rename(tensorboard.parent / "tensorboard")
    assert read(named).name == tensorboard.parent.name  # RUN/tensorboard is named RUN
    run = read(named, "no MTP")
    assert run.name == "no MTP" and run.depths() == 0
    assert run.series["lm loss"] == {1: 4.25, 4: 3.25}
    assert run.series["grad norm"] == {1: 2.0, 4: 2.0} and "grad-norm" not in run.series
    assert run.series["learning rate"] == pytest.approx({1: 1e-3, 4: 1e-3}, rel=1e-7)  # float32 events
    assert run.series["elapsed time per iteration (ms)"] == pytest.approx({1: 900.0, 4: 100.0}, rel=1e-6)
    assert run.series["lm loss validation"] == {4: 3.5}
    assert not any(name.endswith(" vs samples") for name in run.series)
    assert run.tokens == {1: 4 * SEQ, 4: 28 * SEQ}


def test_the_tool_overlays_both_kinds_of_run_and_tables_their_last_values(console, tensorboard, tmp_path):
    svg, png = tmp_path / "curves.svg", tmp_path / "curves.png"
    result = plot(f"no MTP={tensorboard}", str(console), "-o", str(svg), "--x", "tokens", "--table")
    assert result.returncode == 0, result.stderr
    assert ("read run 2/2: attached (2 logged iterations)" in result.stderr
            and "drawing 2 runs" in result.stderr)  # progress on stderr
    table = result.stdout.strip().splitlines()
    assert table[0].startswith("| run | iteration | lm loss | lm loss validation | mtp_1 loss | mtp_2 loss |")
    assert table[2] == "| no MTP | 4 | 3.2500 | 3.5000 | - | - | - | - | - | - | - | - | - | 2.0000 | 500.0 |"
    assert table[3] == ("| attached | 4 | 3.0000 | 3.0500 | 3.5000 | 3.6000 | 0.3000 | 0.2000 | 0.1500 | 0.1200 "
                        "| 1.4000 | 1.3500 | 1.2500 | 1.0000 | 500.0 |")
    text = svg.read_text()
    assert text.startswith("<?xml") and "attached mtp_2" in text and "no MTP" in text
    assert "attached validation" in text and "no MTP validation" in text  # the lm loss panel's validation lines
    again = tmp_path / "again.svg"
    assert plot(f"no MTP={tensorboard}", str(console), "-o", str(again), "--x", "tokens").returncode == 0
    assert again.read_bytes() == svg.read_bytes()  # byte-reproducible figures (committed to docs)
    assert plot(str(console), "-o", str(png)).returncode == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("case", ["missing", "no events", "no iterations", "extension", "tokens unknown",
                                  "two runs in one directory", "one name twice", "no output directory"])
def test_bad_runs_are_refused_in_one_line(case, console, tensorboard, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    other = tmp_path / "other.log"
    other.write_text("hello\n")
    no_arguments = tmp_path / "no_arguments.log"
    no_arguments.write_text("\n".join(line for line in CONSOLE.splitlines() if "seq_length" not in line))
    args, expected = {
        "missing": ((str(tmp_path / "nope"), "-o", str(tmp_path / "a.png")), "no such file or directory"),
        "no events": ((str(empty), "-o", str(tmp_path / "a.png")), "without TensorBoard event files"),
        "no iterations": ((str(other), "-o", str(tmp_path / "a.png")), "no iteration lines"),
        "extension": ((str(console), "-o", str(tmp_path / "a.txt")), "give a .png, .svg or .pdf file"),
        "tokens unknown": ((str(no_arguments), "-o", str(tmp_path / "a.png"), "--x", "tokens"),
                           "no consumed samples or sequence length in no_arguments"),
        "two runs in one directory": ((str(tmp_path), "-o", str(tmp_path / "a.png")), "holds the events of 2 runs"),
        "one name twice": ((f"x={console}", f"x={tensorboard}", "-o", str(tmp_path / "a.png")),
                           "two runs are named 'x'"),
        "no output directory": ((str(console), "-o", str(tmp_path / "nowhere" / "a.png")), "no directory"),
    }[case]
    if case == "two runs in one directory":  # a second run beside the fixture's no_mtp/
        import shutil

        shutil.copytree(tensorboard, tmp_path / "another")
    result = plot(*args)
    lines = [line for line in result.stderr.splitlines() if ": read run " not in line]  # progress before it
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("plot_runs.py: error: ") and expected in lines[0], result.stderr
    assert not list(tmp_path.glob("a.*"))
    if case in ("missing", "no events", "no iterations", "two runs in one directory"):
        with pytest.raises(RunError, match=expected):
            read(args[0])


def test_the_reader_names_the_trainer_s_metric_as_the_trainer_does():
    from megatron.core.fork.mtp.statistics import EXPECTED_LENGTH_GREEDY, EXPECTED_LENGTH_SAMPLING
    from megatron.core.fork.training_loop.metrics import EXPECTED_LENGTH

    assert EXPECTED_LENGTH_NAME == EXPECTED_LENGTH
    assert SAMPLING_LENGTH_NAME == EXPECTED_LENGTH_SAMPLING and GREEDY_LENGTH_NAME == EXPECTED_LENGTH_GREEDY
