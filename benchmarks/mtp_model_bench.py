"""Side-by-side cost of the MTP model options on CPU (one process, gloo world of one).

    .venv/bin/python benchmarks/mtp_model_bench.py

Step time (forward + backward of one micro-batch) is measured in one run with the
variants interleaved round by round, and reported as medians and ratios:
isolation on vs off (distinct layers, D = 2) and repeated vs distinct (isolation on).
Peak memory of a step for D = 0, 1 and 3 is measured in fresh subprocesses as the growth
of resident memory during one step (sampled every millisecond).
"""

import os
import statistics
import subprocess
import sys
import time
import warnings

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPE = dict(vocab=8192, hidden=256, heads=8, layers=4, seq=256, batch=4)


def setup_process():
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500))
    dist.init_process_group("gloo")
    from megatron_mtp.initialize import initialize_model_parallel

    initialize_model_parallel(1, 1, None, 1234)


def make(depths, detach, repeated):
    import torch

    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_mtp.model import build_gpt

    config = TransformerConfig(num_layers=SHAPE["layers"], hidden_size=SHAPE["hidden"],
                               num_attention_heads=SHAPE["heads"], mtp_num_layers=depths or None,
                               mtp_detach_heads=detach, mtp_use_repeated_layer=repeated,
                               hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                               calculate_per_token_loss=True)
    torch.manual_seed(0)
    model = build_gpt(config, SHAPE["vocab"], SHAPE["seq"])
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab"], (SHAPE["batch"], SHAPE["seq"] + 1), generator=g)
    return model, tokens


def step(model, tokens):
    import torch

    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.size(1)).unsqueeze(0).expand_as(inputs)
    mask = torch.ones_like(labels, dtype=torch.float)
    model.zero_grad(set_to_none=True)
    out = model(inputs, positions, None, labels=labels, loss_mask=mask)
    (out * mask).sum().backward()


def timing(rounds=8):
    setup_process()
    variants = {
        "attached, distinct": make(2, False, False),
        "isolated, distinct": make(2, True, False),
        "isolated, repeated": make(2, True, True),
    }
    for model, tokens in variants.values():
        step(model, tokens)  # warm-up
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, tokens) in variants.items():
            start = time.perf_counter()
            step(model, tokens)
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    for name, value in med.items():
        print(f"  {name:20s} {value * 1000:8.1f} ms/step (median of {rounds})")
    print(f"  ratio isolation on / off (distinct, D=2):   {med['isolated, distinct'] / med['attached, distinct']:.3f}")
    print(f"  ratio repeated / distinct (isolated, D=2):  {med['isolated, repeated'] / med['isolated, distinct']:.3f}")


def peak_memory(depths):
    """Peak resident memory during one step above the resident memory just before it,
    sampled every millisecond by a thread (CPU tensors have no allocator statistics)."""
    import threading

    import psutil

    setup_process()
    model, tokens = make(depths, depths > 0, False)
    process = psutil.Process()
    baseline, peak, done = process.memory_info().rss, [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    step(model, tokens)
    done.set()
    sampler.join()
    print(f"{(peak[0] - baseline) / 2**20:.1f}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--peak-memory":
        return peak_memory(int(sys.argv[2]))
    print(f"shape: {SHAPE}")
    print("step time:")
    timing()
    logits_mb = SHAPE["batch"] * SHAPE["seq"] * SHAPE["vocab"] * 4 / 2**20
    print(f"peak memory growth of one step (one depth's fp32 logits: {logits_mb:.0f} MiB):")
    peaks = {}
    for depths in (0, 1, 3):
        out = subprocess.run([sys.executable, __file__, "--peak-memory", str(depths)],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        peaks[depths] = float(out)
        print(f"  D={depths}: {peaks[depths]:8.1f} MiB")
    print(f"  per extra depth (D=3 vs D=1, divided by 2): {(peaks[3] - peaks[1]) / 2:.1f} MiB")


if __name__ == "__main__":
    main()
