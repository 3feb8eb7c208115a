# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Part "fixes": fixes of upstream's behaviour, independent of MTP, that the fixes patches call.

- norms: sequence parallelism and zero-centred gamma with the torch norms.
- chained_optimizer_state: a chained optimizer's state loaded by a chain of another length.
- synchronous_save: a synchronous save keeps its write results in this process.
- checkpoint_files: the tracker file written atomically, a checkpoint verified before a load.
"""
