#!/usr/bin/env python3
# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Hugging Face <-> megatron-core checkpoints for Llama / Qwen2 / MiMo / Qwen3 / Qwen3-MoE / DeepSeek-V3 /
GLM-4.5 / Qwen3-Next / Qwen3.5 backbones and their MTP heads.

    # a Hugging Face model into the trainer (draft heads for an existing model)
    tools/convert_checkpoint.py import HF_DIR OUT_DIR [--mtp-num-layers D] [--tensor-model-parallel-size T]
    torchrun ... pretrain_gpt_mtp.py $(cat OUT_DIR/megatron_flags.txt) --load OUT_DIR --finetune \\
        --freeze-backbone --mtp-detach-heads ...

    # a trainer checkpoint (any TP / PP / VPP layout) to Hugging Face, MTP depths in MiMo's layout
    tools/convert_checkpoint.py export RUN_DIR OUT_DIR [--mtp-layout LAYOUT|none] [--architecture FAMILY]
        [--expert-layout per_expert|stacked]
        [--dtype fp32|bf16] [--tokenizer DIR]

import reads config.json and safetensors (model.safetensors, or shards with
model.safetensors.index.json) of a LlamaForCausalLM, Qwen2ForCausalLM, MiMoForCausalLM (Qwen2
with model.mtp_layers), Qwen3ForCausalLM (q/k norms: --qk-layernorm), Qwen3MoeForCausalLM (and its
experts), DeepseekV3ForCausalLM (multi-latent attention with YaRN, sigmoid-routed experts with
an expert bias, groups and a shared expert behind dense first layers), Glm4MoeForCausalLM
(GLM-4.5: QKV biases, q/k norms, partial rotary, DeepSeek-V3's experts) or Qwen3NextForCausalLM
(GPTModel with --experimental-attention-variant gated_delta_net: Gated DeltaNet layers, gated
attention with q/k norms and partial rotary, (1 + w) norms, experts with a gated shared expert;
the Gated DeltaNet output norm shifted by one), Qwen3_5ForCausalLM or Qwen3_5MoeForCausalLM
(Qwen3.5: the same model, dense or with experts in every layer, its Gated DeltaNet input
projections in_proj_qkv / _z / _b / _a; the published Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration: their text_config and language model, with the MTP depths,
the vision tower left out and said so), and MTP depths when present (MiMo's
model.mtp_layers.{i}.*, DeepSeek-V3's model.layers.{L+k}.*, or Qwen3-Next's and Qwen3.5's
mtp.layers.{k}.* with its one mtp.fc and set of norms, on a last full-attention layer), the experts
of any MoE family stored one per expert or stacked (mlp.experts.gate_up_proj, down_proj); it writes
a torch_dist release checkpoint that pretrain_gpt_mtp.py --load DIR --finetune loads at any PP
layout and at the tensor-parallel size given (the vocabulary is padded as the trainer pads it
there), and the model flags that build it, dropout included (OUT_DIR/megatron_flags.txt, also printed).
--mtp-num-layers D adds MTP depths the Hugging Face checkpoint does not have, initialized as
megatron-core initializes them (seeded by --seed).

export writes the backbone as Llama (Qwen2 when the model has QKV biases, Qwen3 when it has q/k
norms; MiMo when it was imported
from MiMo, or with --architecture mimo, so that vLLM and SGLang pick their MiMo MTP model; Qwen3-MoE
with experts and q/k norms, DeepSeek-V3 with multi-latent attention and experts, GLM-4.5 with
sigmoid-routed experts without it, Qwen3-Next with Gated DeltaNet layers and experts, Qwen3.5
without experts, Qwen3.5-MoE when the import's own checkpoint is exported (a trained run's saves the
trainer's arguments, without the family) or with --architecture qwen3_5_moe, each the
text-only form; --architecture qwen3_next writes a Qwen3.5-MoE import as Qwen3-Next): config.json,
model.safetensors, the tokenizer's files when --tokenizer is given; the MTP depths in MiMo's
layout (default; DeepSeek-V3's for the MoE families, Qwen3-Next's for Qwen3-Next and Qwen3.5),
DeepSeek-V3's
(with the copies of the output weight and embedding that its loaders read) or Qwen3-Next's (its
depths' fc and norms must be the same: the layout holds one), num_nextn_predict_layers in
config.json (and Qwen3-Next's and Qwen3.5's mtp_num_hidden_layers); the experts as the family's
published checkpoints store them (Qwen3.5-MoE's decoder layers stacked, its MTP depths and every
other family's one per expert) or as --expert-layout says. A checkpoint trained with
--mtp-use-repeated-layer is written as D identical depths (one per depth it was trained at).
Checked (tests/test_serving.py, tests/test_bridges.py): the import's logits equal transformers'
(fp32, relative 1e-5; measured <= 8.7e-7), the MTP depths equal the engines' MTP forward, import
then export gives the original tensors bit for bit, and transformers loads the export.

export's tensors are megatron_mtp.serving.export's, which the weight stream of a live model
(megatron_mtp.serving.stream: an RL framework's push to its rollout engine) yields too, bit for bit
equal to the files written here. Where vLLM is known to serve the written MTP layout otherwise than
megatron-core trained it, the output line ends with a warning (docs/serving.md).

Both write into a temporary sibling directory renamed into place when complete. Bad input
is one line, `convert_checkpoint.py: error: ...`, exit status 2, and nothing written.
"""

import argparse
import functools
import os
import sys
import warnings

from megatron_mtp import cli

PROG = "convert_checkpoint.py"
fail = functools.partial(cli.fail, PROG)  # one line on stderr, exit status 2 (or given)


def parse(argv):
    from megatron_mtp.serving import families  # (imports torch: after main's settings)

    same_shape = ", ".join(f"{f.name} as {f.same_shape_as}" for f in families.FAMILIES.values() if f.same_shape_as)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="Hugging Face checkpoint -> megatron-core torch_dist checkpoint")
    imp.add_argument("source", help="Hugging Face checkpoint directory (config.json, safetensors)")
    imp.add_argument("output", help="new (or empty) directory for the megatron-core checkpoint")
    imp.add_argument("--mtp-num-layers", type=int, default=None,
                     help="MTP depths of the imported model (default: those of the checkpoint); depths beyond "
                          "the checkpoint's are newly initialized")
    imp.add_argument("--mtp-use-repeated-layer", action="store_true",
                     help="import identical MTP depths as one repeated layer")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                     help="Megatron's flag, written into megatron_flags.txt: the trainer pads the vocabulary to a "
                          "multiple of this times its tensor-parallel size")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1,
                     help="the tensor-parallel size the import is fine-tuned at: the vocabulary is padded as the "
                          "trainer pads it there (the model flags load at this size)")
    imp.add_argument("--seed", type=int, default=1234, help="initialization of new MTP depths")
    exp = commands.add_parser("export", help="megatron-core checkpoint -> Hugging Face checkpoint")
    exp.add_argument("source", help="trainer checkpoint: the --save directory (its tracker names the iteration) "
                                    "or an iter_NNNNNNN / release directory")
    exp.add_argument("output", help="new (or empty) directory for the Hugging Face checkpoint")
    exp.add_argument("--mtp-layout", choices=[*families.MTP_LAYOUTS, "none"], default=None,
                     help="how the MTP depths are written (default: the layout the family's vLLM drafter reads, "
                          "megatron_mtp.serving.families, or none for a family no engine drafts for; none: the "
                          "backbone only)")
    exp.add_argument("--architecture", choices=list(families.FAMILIES), default=None,
                     help="config.json's family (default: the imported one, else the family of the model's shape, "
                          "or, with MTP depths, the family of the same shape that vLLM drafts for, if any, "
                          f"megatron_mtp.serving.families); the same model stored otherwise: {same_shape} (and back; "
                          "mimo makes vLLM and SGLang serve the MTP depths as MiMo's)")
    exp.add_argument("--expert-layout", choices=["per_expert", "stacked"], default=None,
                     help="how the routed experts are stored: one tensor each per expert (mlp.experts.{e}.gate_proj "
                          "...) or stacked (mlp.experts.gate_up_proj [E, 2F, H], down_proj [E, H, F]); default: as "
                          "the family's published checkpoints (stacked decoder layers and per-expert MTP depths for "
                          "Qwen3.5-MoE, per expert for the others)")
    exp.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    exp.add_argument("--tokenizer", help="tokenizer directory (or file) whose files are copied beside the model")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0)
    return parser.parse_args(argv)


def run_import(args) -> int:
    from megatron_mtp.serving import ServingError, files, mapping
    from megatron_mtp.serving.config import ModelConfig

    out = files.check_output(args.output)
    config, tensors = files.read_hf(args.source)
    config, tensors, vision = mapping.unwrap_vlm(config, tensors)
    if args.make_vocab_size_divisible_by < 1 or args.tensor_model_parallel_size < 1:
        raise ServingError("--make-vocab-size-divisible-by and --tensor-model-parallel-size must be >= 1")
    cfg = ModelConfig.from_hf(config, pad_to=args.make_vocab_size_divisible_by * args.tensor_model_parallel_size)
    layout, depths = mapping.detect_mtp(tensors, cfg)
    wanted = depths if args.mtp_num_layers is None else args.mtp_num_layers
    if wanted < 0:
        raise ServingError("--mtp-num-layers must be >= 0")
    mapping.check_mtp(cfg, layout, wanted, written=False)
    global_tensors = mapping.hf_to_megatron(tensors, cfg, layout, depths)
    if wanted < depths:  # drop the deeper depths
        global_tensors = {k: v for k, v in global_tensors.items()
                          if not k.startswith("mtp.layers.") or int(k.split(".")[2]) < wanted}
        depths = wanted
    if args.mtp_use_repeated_layer:
        if not wanted:
            raise ServingError("--mtp-use-repeated-layer needs MTP depths")
        global_tensors = mapping.collapse_repeated(global_tensors, depths)
    cfg.mtp_num_layers, cfg.mtp_repeated = wanted, args.mtp_use_repeated_layer
    megatron_args = cfg.megatron_args()
    flags = cfg.trainer_flags(args.make_vocab_size_divisible_by)
    with files.Staging(out) as staging:
        initialized = files.write_megatron(staging, megatron_args, global_tensors, depths, seed=args.seed)
        others = [n for n in initialized if not n.startswith("mtp.layers.")]
        if others:  # every backbone parameter must come from the checkpoint; checked before the rename
            raise ServingError(f"internal: backbone parameter {others[0]} was not imported")
        (staging / files.FLAGS_FILE).write_text(" ".join(flags) + "\n")
    new_depths = sorted({int(n.split(".")[2]) + 1 for n in initialized if n.startswith("mtp.layers.")})
    print(f"{PROG}: imported {cfg.family} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocabulary "
          f"{cfg.vocab_size} padded to {cfg.padded_vocab_size}, {'tied' if cfg.tied else 'untied'} embeddings"
          f"{', MTP depths ' + str(depths) + ' from ' + layout + ' layout' if depths else ''}"
          f"{', new MTP depths ' + str(new_depths) + ' initialized' if new_depths else ''}"
          f"{'; the language model alone, the vision tower (' + str(vision) + ' tensors) left out' if vision else ''}"
          f") into {out}")
    print(f"{PROG}: model flags for tensor-parallel size {args.tensor_model_parallel_size} (also in "
          f"{out / files.FLAGS_FILE}; another size pads the vocabulary otherwise: import again with "
          f"--tensor-model-parallel-size): {' '.join(flags)}")
    return 0


def run_export(args) -> int:
    from megatron_mtp.serving import ServingError, experts, export, files

    out = files.check_output(args.output)
    if args.tokenizer and not os.path.exists(args.tokenizer):
        raise ServingError(f"--tokenizer {args.tokenizer}: no such file or directory")
    run_args, directory = files.read_arguments(args.source)
    if run_args is None:
        raise ServingError(f"{directory}: the checkpoint holds no arguments (not written by the trainer or import)")
    plan = export.plan(run_args, args.mtp_layout, args.architecture, args.expert_layout)
    cfg, layout = plan.cfg, plan.layout
    _, tensors, _ = files.read_megatron(args.source)
    hf = export.hf_tensors(plan, tensors, str(directory))
    config = cfg.to_hf(args.dtype, layout)
    with files.Staging(out) as staging:
        copied = files.write_hf(staging, config, hf, args.dtype, args.tokenizer,
                                max_shard_bytes=int(args.max_shard_size_gb * 2**30))
    mtp = "no MTP depths"
    if cfg.mtp_num_layers and layout:
        mtp = f"{cfg.mtp_num_layers} MTP depths in {layout}'s layout"
        if cfg.mtp_repeated:
            mtp += f" (the one repeated layer written {cfg.mtp_num_layers} times, identical)"
    elif cfg.mtp_num_layers:
        mtp = f"the backbone only ({cfg.mtp_num_layers} MTP depths left out)"
    stored = experts.describe(cfg.adapter.published_experts, plan.expert_layout)
    warned = "".join(f"; warning: {line}" for line in export.engine_warnings(cfg, layout))
    print(f"{PROG}: exported {directory} as {config['architectures'][0]} ({args.dtype}), {mtp}"
          f"{', ' + stored if stored else ''}"
          f"{', tokenizer files ' + ', '.join(copied) if copied else ''} into {out}{warned}")
    if plan.note:
        print(f"{PROG}: {plan.note}")
    if not copied:  # what the engines (and transformers' pipelines) read beside the weights
        print(f"{PROG}: no tokenizer files written: give --tokenizer DIR (the run's tokenizer.json or its "
              "directory) for the engines; a run tokenized as bytes has none of Hugging Face's")
    if cfg.mtp_num_layers and layout:
        print(f"{PROG}: transformers' {config['architectures'][0]} runs no MTP: it loads the backbone and leaves "
              "the MTP depths' tensors unused (some classes list them as unexpected); the depths are the drafts of "
              "vLLM's and SGLang's speculative decoding (docs/serving.md), and --mtp-layout none leaves them out")
    return 0


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    args = parse(argv if argv is not None else sys.argv[1:])
    from megatron_mtp.serving import ServingError

    try:
        return run_import(args) if args.command == "import" else run_export(args)
    except ServingError as error:
        return fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
