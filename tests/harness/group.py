# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""Several test bodies in one launch: each process imports megatron-core once (seconds per
rank) and runs the bodies one after another, in the order given.

    results = launch("tests.harness.group:run_bodies", 1, {"bodies": {
        "extremes": ["tests.bodies.sparse_loss:mask_extremes", {}],
        "rows": ["tests.bodies.sparse_loss:last_depth_rows_by_mode", {}]}}, build=build)
    results[0]["extremes"]  # rank 0's return value of mask_extremes()

A body that raises fails the whole launch with its traceback (as a launch of it alone would).
"""

import importlib


def run_bodies(bodies: dict) -> dict:
    """{name: ["package.module:function", kwargs]} -> {name: function(**kwargs)}."""
    results = {}
    for name, (body, kwargs) in bodies.items():
        module_name, function_name = body.split(":")
        results[name] = getattr(importlib.import_module(module_name), function_name)(**(kwargs or {}))
    return results
