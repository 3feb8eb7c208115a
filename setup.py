# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Megatron-MTP: exact multi-token-prediction training as a patch series over megatron-core.

This installs the fork-owned trainer package (megatron_mtp) and the project's
dependencies. The patched megatron-core itself is built and installed by
`tools/fork install` (see docs/series.md, "Builds, and how fork-owned files reach
`megatron.core`", and docs/fork-tool.md): it is upstream source plus patches/, not a
package published from here.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-mtp",
    version="0.1.0",
    description="Exact multi-token-prediction (MTP) training for Megatron-LM / megatron-core",
    license="Apache-2.0",  # megatron-core's; see LICENSE and NOTICE
    python_requires=">=3.11",  # the tooling uses tomllib; the fork-owned megatron-core modules run on 3.10
    packages=find_packages(include=["megatron_mtp", "megatron_mtp.*"]),
    install_requires=[
        # The local CPU wheel (2.13.0) satisfies this range; a newer major needs re-validation.
        "torch>=2.6,<2.14",
        "numpy",
        "packaging>=24.2",
        "typing_extensions",  # megatron-core 0.17+ (and its Python 3.11 patch) import it
        "psutil",  # dist checkpointing
    ],
    extras_require={
        # tools/preprocess_data.py with a tokenizer.json or a SentencePiece model
        "data": ["tokenizers>=0.20", "sentencepiece>=0.2"],
        # --tensorboard-dir and --wandb-project of pretrain_gpt_mtp.py
        "logging": ["tensorboard>=2.16", "wandb>=0.17"],
        # tools/plot_runs.py (figures of runs) and the experiments that draw them
        "plot": ["matplotlib>=3.8", "tensorboard>=2.16"],
        # tools/convert_checkpoint.py and tools/eval_speculative.py (Hugging Face checkpoints); the trainer
        # does not need them
        "serve": ["transformers>=5", "safetensors>=0.4"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "tokenizers>=0.20", "sentencepiece>=0.2", "tensorboard>=2.16",
                 "wandb>=0.17", "transformers>=5", "safetensors>=0.4", "matplotlib>=3.8",
                 "ruff==0.17.6"],  # the linter tests/test_repository.py runs (ruff.toml); pinned: its rules move
        # GPU only, never needed on CPU. NVIDIA apex is built from source (see docs/gpus.md);
        # the PyPI package named `apex` is an unrelated project.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12", "flash-attn>=2.6"],
    },
)
