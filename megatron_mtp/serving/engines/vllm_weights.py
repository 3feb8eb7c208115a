# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A transport for vLLM's weight-transfer lifecycle that its CPU build can run: files in shared memory.

vLLM 0.32.0 gives RL frameworks one way to put new weights into a live engine, target and draft
model alike (vllm/v1/worker/gpu_worker.py, which the CPU worker extends): a weight-transfer engine
chosen by `weight_transfer_config`, driven by the worker's `start_weight_update` (or
`start_draft_weight_update`: the speculative drafter), `update_weights` (one chunk), and
`finish_weight_update`. Its transports (NCCL, CUDA IPC and their variants) need a GPU; this one
takes each chunk as a safetensors file the trainer's process wrote (one bucket of
megatron_mtp.serving.stream, in /dev/shm) and hands its tensors to the session's model's
`load_weights`. Like vLLM's NCCL engine, it runs the session inside vLLM's layerwise reload
(`initialize_layerwise_reload` / `finalize_layerwise_reload`), so whatever a layer computes from its
weights after loading (a CPU GEMM's packed copy, for one) is computed again from the new ones.

Runs in the engine's interpreter (vLLM's environment): it imports vLLM, torch and safetensors only.
vllm_server.py registers it before it builds the engine, under BACKEND.
"""

from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

BACKEND = "megatron_mtp_files"


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    pass


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str  # a safetensors file of Hugging Face names, read whole, left for its writer to delete


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass  # nothing to connect: every chunk names its file

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict) -> None:
        # the base class then synchronizes an accelerator; a CPU load is done when load_weights returns
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        from safetensors.torch import load_file

        self.model.load_weights(list(load_file(update_info.path).items()))

    def shutdown(self) -> None:
        pass


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine(BACKEND, FileWeightTransferEngine)
