#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Draw training runs of pretrain_gpt_mtp.py side by side: losses, acceptance, grad norms, learning rate.

    tools/plot_runs.py runs/a/tensorboard runs/b/tensorboard -o curves.png
    tools/plot_runs.py "no MTP=logs/a.log" "detached=logs/b.log" --x tokens -o curves.svg --table

Each RUN is a TensorBoard directory (the trainer's --tensorboard-dir) or a console log (what
torchrun printed), optionally named as NAME=PATH (default: the file's or directory's name;
the last "=" separates them).
Runs are overlaid, one colour each, against iterations or tokens (--x; tokens = consumed
samples x sequence length), in panels: lm loss (and the validation's); each depth's MTP loss (line style by
depth); acceptance, chain acceptance, sampled acceptance and greedy-draft acceptance per depth; expected
accepted length (incl. bonus token), teacher-forced, sampling and greedy drafts;
grad norm (and, with --mtp-detach-heads, the MTP group's); learning rate; and for the RL
example's log (examples/rl/grpo.py) reward and solved fraction, the rollouts' acceptance per
depth and their mean acceptance length, and its engine decodes' in both draft modes. A panel that no run has
is left out.
The format follows the output's extension (.png, .svg, .pdf).
--table prints a Markdown table of each run's last logged values (the last evaluation's lm
loss among them) and its median time per iteration. Runs are drawn from the widest line (the
first) to the narrowest, so a run equal to an earlier one shows inside the earlier one's line.
Progress goes to stderr; a bad RUN is refused in one line (exit status 2).
"""

import argparse
import functools
import os
import re
import statistics
import sys

from megatron_mtp import cli
from megatron_mtp.runs import EXPECTED_LENGTH_NAME, GREEDY_LENGTH_NAME, SAMPLING_LENGTH_NAME, RunError, read

PROG = "plot_runs.py"
fail = functools.partial(cli.fail, PROG)  # one line on stderr, exit status 2 (or given)
ROLLOUT_LENGTH = "rollout mean acceptance length (incl. bonus)"  # examples/rl/grpo.py's decoding
ENGINE_LENGTH = "engine mean acceptance length (incl. bonus)"  # its rejection-sampling decodes
ENGINE_GREEDY_LENGTH = "engine mean acceptance length (incl. bonus) (greedy drafts)"  # ... with greedy drafts
ITERATION_TIME = "elapsed time per iteration (ms)"
LINE_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))  # a panel's second, third... series (depths)




def parse(argv):
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="[NAME=]PATH: a TensorBoard directory or a console log")
    parser.add_argument("-o", "--output", required=True, help="the figure: .png, .svg or .pdf")
    parser.add_argument("--x", choices=("iterations", "tokens"), default="iterations", help="the horizontal axis")
    parser.add_argument("--title", default=None)
    parser.add_argument("--table", action="store_true", help="print a Markdown table of the last values")
    return parser.parse_args(argv)


def per_depth(name: str, depths: int) -> list[str]:
    """The series `name` of each MTP depth: mtp_1 <name>, ..., mtp_D <name>."""
    return [f"mtp_{k} {name}" for k in range(1, depths + 1)]


def panels(depths: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """(title, [(series, label suffix)]) of every panel, for a run with `depths` MTP depths."""
    def depth_lines(name):  # each labelled by its depth (mtp_k)
        return [(series, series.split()[0]) for series in per_depth(name, depths)]

    return [
        ("reward (RL)", [("reward", ""), ("solved", "solved")]),
        ("lm loss", [("lm loss", ""), ("lm loss validation", "validation")]),
        ("policy-gradient loss (RL)", [("policy-gradient loss", "")]),
        ("MTP loss", depth_lines("loss")),
        ("acceptance", depth_lines("acceptance")),
        ("chain acceptance", depth_lines("chain acceptance")),
        ("sampled acceptance", depth_lines("sampled acceptance")),
        ("greedy-draft acceptance", depth_lines("greedy-draft acceptance")),
        ("rollout acceptance (RL)", depth_lines("rollout acceptance")),
        ("engine acceptance: rejection sampling (RL)", depth_lines("engine acceptance")),
        ("engine acceptance: greedy drafts (RL)", depth_lines("engine acceptance (greedy drafts)")),
        ("accepted length (incl. bonus token)", [(EXPECTED_LENGTH_NAME, "teacher-forced"),
                                                 (SAMPLING_LENGTH_NAME, "sampling"),
                                                 (GREEDY_LENGTH_NAME, "greedy drafts"),
                                                 (ROLLOUT_LENGTH, "rollouts"),
                                                 (ENGINE_LENGTH, "engine"),
                                                 (ENGINE_GREEDY_LENGTH, "engine, greedy drafts")]),
        ("grad norm", [("grad norm", ""), ("mtp grad norm", "mtp")]),
        ("learning rate", [("learning rate", "")]),
    ]


def draw(runs, x: str, output: str, title: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    # Byte-reproducible SVG: no random ids, no date.
    matplotlib.rcParams["svg.hashsalt"] = "megatron-mtp"
    import matplotlib.pyplot as plt

    depths = max(run.depths() for run in runs)
    shown = [(name, lines) for name, lines in panels(depths)
             if any(series in run.series for run in runs for series, _ in lines)]
    columns = 2 if len(shown) > 1 else 1
    rows = (len(shown) + columns - 1) // columns
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (panel, lines) in zip(axes.flat, shown):
        for index, run in enumerate(runs):
            for style, (series, suffix) in enumerate(lines):
                values = run.series.get(series)
                if not values:
                    continue
                steps = sorted(values)
                if x == "tokens":
                    steps = [step for step in steps if step in run.tokens]
                    xs = [run.tokens[step] for step in steps]
                else:
                    xs = steps
                label = f"{run.name} {suffix}".strip()
                linestyle = "-" if style == 0 else LINE_STYLES[(style - 1) % len(LINE_STYLES)]
                # Earlier runs drawn wider: a run equal to an earlier one shows as a line inside its halo.
                width = 1.0 + 1.4 * (len(runs) - 1 - index) / max(len(runs) - 1, 1)
                axis.plot(xs, [values[step] for step in steps], color=colours[index % len(colours)],
                          linestyle=linestyle, linewidth=width, label=label)
        axis.set_title(panel, fontsize=10)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        if panel == "learning rate":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    for axis in list(axes.flat)[len(shown):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    if output.endswith(".png"):  # 256 colours (a line plot needs no more): a third of the size, to commit
        import io

        from PIL import Image

        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=90)
        buffer.seek(0)
        Image.open(buffer).convert("RGB").quantize(colors=256).save(output, optimize=True)
    else:
        figure.savefig(output, metadata={"Date": None} if output.endswith(".svg") else None)
    plt.close(figure)


def table(runs) -> str:
    """Each run's last logged value of every series some run has, and its median time per iteration."""
    depths = max(run.depths() for run in runs)
    candidates = ["reward", "solved", "lm loss", "lm loss validation", *per_depth("loss", depths),
                  *per_depth("acceptance", depths), *per_depth("sampled acceptance", depths),
                  *per_depth("greedy-draft acceptance", depths), *per_depth("rollout acceptance", depths),
                  *per_depth("engine acceptance", depths), *per_depth("engine acceptance (greedy drafts)", depths),
                  EXPECTED_LENGTH_NAME, SAMPLING_LENGTH_NAME, GREEDY_LENGTH_NAME, ROLLOUT_LENGTH, ENGINE_LENGTH,
                  ENGINE_GREEDY_LENGTH, "grad norm"]
    series = [name for name in candidates if any(name in run.series for run in runs)]
    columns = ["run", "iteration", *series, "ms per iteration"]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    for run in runs:
        last = max(run.series.get("lm loss") or run.series.get("reward") or {0: None})  # RL logs: reward
        cells = [run.name, str(last)]
        for name in series:
            value = run.last(name)
            cells.append("-" if value is None else f"{value:.4f}")
        # The median: the console's first line (iteration 1) holds the start-up.
        times = list(run.series.get(ITERATION_TIME, {}).values())
        cells.append(f"{statistics.median(times):.1f}" if times else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv if argv is not None else sys.argv[1:])
    if not re.search(r"\.(png|svg|pdf)$", args.output):
        return fail(f"--output {args.output}: give a .png, .svg or .pdf file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        return fail(f"--output {args.output}: no directory {os.path.dirname(os.path.abspath(args.output))}")

    runs = []
    try:
        for index, spec in enumerate(args.runs, 1):
            name, sep, path = spec.rpartition("=")  # a name may hold "=" (D=2), a path seldom does
            if not sep or not name or os.path.exists(spec):
                name, path = None, spec
            run = read(path, name)
            if args.x == "tokens" and not run.tokens:
                raise RunError(f"--x tokens: no consumed samples or sequence length in {run.name} (a console log "
                               f"needs upstream's argument dump; TensorBoard events the arguments' text summaries)")
            if any(other.name == run.name for other in runs):
                raise RunError(f"two runs are named {run.name!r}: name them, NAME=PATH")
            runs.append(run)
            print(f"{PROG}: read run {index}/{len(args.runs)}: {run.name} "
                  f"({len(run.iterations())} logged iterations)", file=sys.stderr, flush=True)
    except RunError as error:
        return fail(error)
    print(f"{PROG}: drawing {len(runs)} runs to {args.output}", file=sys.stderr, flush=True)
    draw(runs, args.x, args.output, args.title)
    if args.table:
        print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
