# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A vLLM engine process driven from this project's environment.

    from megatron_mtp.serving.engines.vllm_engine import Engine

    with Engine(export_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as engine:
        reply = engine.generate([[1, 2, 3]], max_tokens=32)   # {"outputs": [[...]], "spec_decode": {...}}

The engine (engines/vllm_server.py) runs in vLLM's own interpreter (`.venv-vllm/bin/python`, or
$MEGATRON_MTP_VLLM_PYTHON), in a session of its own, so that closing it ends vLLM's worker processes
with it. Every reply has a deadline: one that does not come in time closes the engine and raises.
The engine lives across requests, so one started once serves a whole run, its weights updated in
place between requests (`update_weights`: vLLM's weight-transfer lifecycle, the target's or the
drafter's, each batch of tensors passed as a file in shared memory; engines/vllm_weights.py).

Defaults are the CPU build's: fp32, eager mode (no compilation), prompts as token ids
(skip_tokenizer_init: exports of byte-level runs carry no tokenizer), a small KV cache; the context
is the model's (max_position_embeddings) unless max_model_len says less.
"""

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_mtp.serving import ServingError

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVER = Path(__file__).with_name("vllm_server.py")
# one process (the uni executor, the engine core in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0 below),
# which starts in about a third of the time of vLLM's three and serves collective_rpc alike
DEFAULTS = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True, "max_num_seqs": 8,
            "kv_cache_memory_bytes": 64 << 20, "distributed_executor_backend": "uni", "disable_log_stats": False,
            "seed": 0}


def python() -> Path:
    """vLLM's interpreter: $MEGATRON_MTP_VLLM_PYTHON, else this checkout's .venv-vllm."""
    return Path(os.environ.get("MEGATRON_MTP_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")


def available() -> bool:
    return python().is_file() and os.access(python(), os.X_OK)


class Engine:
    def __init__(self, model: str, start_timeout: float = 300, request_timeout: float = 300, log=None, **options):
        if not available():
            raise ServingError(f"no vLLM interpreter at {python()}: run `bash tools/bootstrap --engine vllm`")
        self.request_timeout = request_timeout
        self.options = {**DEFAULTS, "model": str(model), **options}
        # where weight batches pass to the engine: memory (tmpfs) where the system has it
        self.transfer = tempfile.mkdtemp(prefix="megatron-mtp-weights-",
                                         dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        # offline: the model is a local directory, and a hub look-up without network waits for its timeout
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        # the engine's environment is its own; its KV cache is kv_cache_memory_bytes (this legacy
        # variable, when set, overrides it in GiB)
        for name in ("PYTHONPATH", "VLLM_CPU_KVCACHE_SPACE"):
            env.pop(name, None)
        self.process = subprocess.Popen([str(python()), str(SERVER), json.dumps(self.options)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=log if log is not None else subprocess.DEVNULL,
                                        text=True, start_new_session=True, env=env)
        # the speculative decoding it runs, as vLLM's config holds it (None: it drafts nothing)
        self.speculative = self._read(start_timeout, "start")["speculative"]

    def _read(self, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.close()
                    raise TimeoutError(f"vLLM engine: no reply to {what} within {timeout:.0f} s (closed)")
                line = self.process.stdout.readline()
                if not line:
                    code = self.process.wait()
                    self.close()
                    raise RuntimeError(f"vLLM engine exited ({code}) during {what}")
                if line.strip():
                    return json.loads(line)

    def request(self, request: dict) -> dict:
        if self.process.poll() is not None:
            raise RuntimeError("vLLM engine is closed")
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self._read(self.request_timeout, request.get("op", "request"))
        if "error" in reply:
            raise RuntimeError(f"vLLM engine: {reply['error']}")
        return reply

    def generate(self, prompts: list, max_tokens: int, temperature: float | list = 0.0, seed: int | None = None,
                 seeds: list | None = None, stop_token_ids: list | None = None, top_p: float | list = 1.0,
                 steps: bool = False) -> dict:
        """Responses to `prompts` (token ids); `temperature` and `top_p`: one value, or one per prompt;
        `seeds`: one per prompt, in place of `seed`; a response ends with the first of `stop_token_ids`
        (included); `steps`: also every sampling step's [drafts verified, [tokens sampled]] per prompt."""
        return self.request({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                             "temperature": temperature, "top_p": top_p, "seed": seed, "seeds": seeds,
                             "stop_token_ids": stop_token_ids, "steps": steps})

    def update_weights(self, batches, draft: bool = False) -> int:
        """One weight update of the target (draft: the speculative drafter) in place, no restart:
        each batch of (Hugging Face name, tensor) is written to one file, which the engine loads
        and this process deletes before the next is written (one batch in memory at a time, besides
        the engine's). Returns the bytes sent."""
        from safetensors.torch import save_file

        from megatron_mtp.serving.files import unshared

        self.request({"op": "start_weight_update", "draft": draft})
        sent = 0
        for index, batch in enumerate(batches):
            path = Path(self.transfer) / f"batch-{index}.safetensors"
            tensors = {}
            for name, tensor in unshared((name, tensor.detach().cpu().contiguous()) for name, tensor in batch):
                tensors[name] = tensor
                sent += tensor.numel() * tensor.element_size()
            save_file(tensors, str(path))
            del tensors
            try:
                self.request({"op": "update_weights", "path": str(path)})
            finally:
                path.unlink(missing_ok=True)
        self.request({"op": "finish_weight_update"})
        return sent

    def close(self) -> None:
        """Stops the engine: asked first, then its whole process group (vLLM's workers) killed."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # workers left in the engine's session
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        shutil.rmtree(self.transfer, ignore_errors=True)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


if __name__ == "__main__":
    sys.exit("use Engine from Python; the engine process itself is vllm_server.py")
