# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A vLLM engine in a process of its own, as RL frameworks run one: started by
megatron_mtp.serving.engines.vllm_engine with the engine's own interpreter (`.venv-vllm/bin/python`,
`tools/bootstrap --engine vllm`), it builds one `vllm.LLM` and answers requests until told to stop.

    .venv-vllm/bin/python megatron_mtp/serving/engines/vllm_server.py '{"model": DIR, ...}'

Its argument is LLM(...)'s keywords as JSON. Requests are JSON lines on stdin, each answered by one
JSON line on stdout (the engine's own output goes to stderr). Once built it answers {"ready": true,
"speculative": {"method", "num_speculative_tokens", "draft_sample_method"} as vLLM's config holds them,
or null}; then:

    {"op": "generate", "prompts": [[ids], ...], "max_tokens": N, "temperature": T, "top_p": P, "seed": S,
     "seeds": [S, ...], "stop_token_ids": [ids], "steps": false}
        -> {"outputs": [[ids], ...], "spec_decode": {...}}  (this request's spec-decode counters)
        temperature, top_p: one value, or a list of one per prompt (mixed in one batch); seeds: one per
        prompt (a per-request generator each: sampling independent of the batch), in place of seed;
        stop_token_ids: a response ends with the first of them (included); steps: also "steps", per
        prompt every sampling step's [drafts verified, [tokens sampled]] (vllm_probe.record_steps)
    {"op": "start_weight_update", "draft": false}  -> {"done": true}  (draft: the speculative drafter)
    {"op": "update_weights", "path": FILE}  -> {"done": true}  (one bucket: a safetensors file)
    {"op": "finish_weight_update"}  -> {"done": true}  (and the prefix cache emptied: its blocks hold
        keys and values the old weights computed)
    {"op": "probe_drafts", "on": true}  -> {"done": true}  (start recording the drafter's logits)
    {"op": "probe_drafts", "on": false}  -> {"logits": [[[row], ...], ...]}  (stop: one list per drafter
        call, one row per request; vllm_probe.py)
    {"op": "stop"}  -> {"stopped": true}, then the process exits

Weight updates are vLLM's own lifecycle (the worker's start_weight_update / start_draft_weight_update,
update_weights, finish_weight_update, reached through LLM.collective_rpc) over the transport of
vllm_weights.py, which this process registers and selects (weight_transfer_config) before it builds
the engine.

An error in a request is answered {"error": "..."} and the engine stays up. It imports vLLM and the
standard library only: this project is not installed in the engine's environment (vLLM pins its own
transformers). LLM(...) runs under `__main__` because vLLM spawns its worker processes.
"""

import json
import os
import sys

# vLLM's counters (LLM.get_metrics) -> the names this protocol reports
COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos": "accepted per position"}


def counters(llm) -> dict:
    out = {}
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            out[COUNTERS[metric.name]] = list(metric.values) if hasattr(metric, "values") else int(metric.value)
    return out


def difference(after: dict, before: dict) -> dict:
    """This request's counts: the engine's counters accumulate over its life."""
    out = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            old = old or [0] * len(value)
            out[name] = [a - b for a, b in zip(value, old + [0] * (len(value) - len(old)))]
        else:
            out[name] = value - (old or 0)
    return out


def per_prompt(value, count: int, name: str) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"{len(value)} values of {name} for {count} prompts")
    return value


def generate(llm, request: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = request["prompts"]
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise ValueError("prompts must be non-empty lists of token ids")
    seeds = request.get("seeds") or [request.get("seed")] * len(prompts)
    temperatures, top_ps = (per_prompt(request.get(name, default), len(prompts), name)
                            for name, default in (("temperature", 0.0), ("top_p", 1.0)))
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    params = [SamplingParams(max_tokens=int(request["max_tokens"]), temperature=float(temperature),
                             top_p=float(top_p), seed=seed, ignore_eos=True,
                             stop_token_ids=request.get("stop_token_ids"), detokenize=False)
              for seed, temperature, top_p in zip(seeds, temperatures, top_ps, strict=True)]
    if request.get("steps"):
        import vllm_probe

        llm.collective_rpc(vllm_probe.record_steps, args=(True,))
    before = counters(llm)
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    reply = {"outputs": [list(r.outputs[0].token_ids) for r in results],
             "spec_decode": difference(counters(llm), before)}
    if request.get("steps"):
        [steps] = llm.collective_rpc(vllm_probe.recorded_steps)
        llm.collective_rpc(vllm_probe.record_steps, args=(False,))
        # the engine core's request ids are the caller's with a random suffix ("3-b57e2aa3")
        steps = {internal.rsplit("-", 1)[0]: recorded for internal, recorded in steps.items()}
        reply["steps"] = [steps[r.request_id] for r in results]
    return reply


def speculative(llm) -> dict | None:
    """The speculative decoding the engine runs, as vLLM's own config holds it (None: it drafts nothing)."""
    config = llm.llm_engine.vllm_config.speculative_config
    if config is None:
        return None
    return {name: getattr(config, name) for name in ("method", "num_speculative_tokens", "draft_sample_method")}


def weight_update(llm, request: dict) -> dict:
    """One step of vLLM's weight-update lifecycle on every worker."""
    op = request["op"]
    if op == "start_weight_update":
        llm.collective_rpc("start_draft_weight_update" if request.get("draft") else "start_weight_update")
    elif op == "update_weights":
        llm.collective_rpc("update_weights", args=({"path": str(request["path"])},))
    else:
        llm.collective_rpc("finish_weight_update")
        llm.reset_prefix_cache()
    return {"done": True}


def probe_drafts(llm, request: dict) -> dict:
    import vllm_probe

    if request.get("on"):
        llm.collective_rpc(vllm_probe.record, args=(True,))
        return {"done": True}
    [logits] = llm.collective_rpc(vllm_probe.recorded)
    llm.collective_rpc(vllm_probe.record, args=(False,))
    return {"logits": logits}


OPS = {"generate": generate, "probe_drafts": probe_drafts, "start_weight_update": weight_update,
       "update_weights": weight_update, "finish_weight_update": weight_update}


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel
    os.dup2(2, 1)  # whatever vLLM or a worker prints goes to stderr
    options = json.loads(sys.argv[1])
    import vllm_weights  # beside this file: the script's directory is on sys.path
    from vllm import LLM

    vllm_weights.register()
    llm = LLM(**options, weight_transfer_config={"backend": vllm_weights.BACKEND})
    replies.write(json.dumps({"ready": True, "speculative": speculative(llm)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request.get("op") == "stop":
                replies.write(json.dumps({"stopped": True}) + "\n")
                break
            if request.get("op") not in OPS:
                raise ValueError(f"unknown op {request.get('op')!r} ({', '.join(OPS)}, stop)")
            reply = OPS[request["op"]](llm, request)
        except Exception as error:  # the request's failure, not the engine's: answer it and go on
            reply = {"error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
