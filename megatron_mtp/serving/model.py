# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""megatron-core's GPTModel (the trainer's local specs with SDPA attention; dense, MoE, with Gated DeltaNet
layers) or HybridModel (the trainer's local hybrid stack: attention, MLP, MoE and Gated DeltaNet layers)
in one process.

A checkpoint saved at any TP / PP / VPP layout is read into it through megatron-core's dist
checkpointing (the resharding is upstream's); its forward is run piece by piece, as
GPTModel's own training path does, so that the main head's hidden states h^0 and each MTP
depth (megatron-core's MultiTokenPredictionLayer, with the token ids given directly as in its
speculative-decoding entry point `forward_single_position`) can be read separately.
"""

import contextlib
import functools
import os

import torch

from megatron_mtp.serving import ServingError

# Flags under which the forward differs from what this module builds.
UNSUPPORTED = ("apply_layernorm_1p", "squared_relu")
# How this module runs a model: one process, fp32, no CUDA kernels (the arguments a checkpoint holds
# name the run that trained it).
ONE_PROCESS = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
    expert_tensor_parallel_size=1, context_parallel_size=1, sequence_parallel=False, params_dtype=torch.float32,
    fp16=False, bf16=False, fp8=None, apply_rope_fusion=False, bias_swiglu_fusion=False, bias_gelu_fusion=False,
    masked_softmax_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
    no_persist_layer_norm=True, recompute_granularity=None, recompute_method=None, recompute_num_layers=None,
    transformer_impl="local", decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
    num_layers_per_virtual_pipeline_stage=None, virtual_pipeline_model_parallel_size=None,
    hidden_dropout=0.0, attention_dropout=0.0)
# MoE options that name CUDA kernels: the same routing and experts run without them.
MOE_KERNELS = ("moe_grouped_gemm", "moe_permute_fusion", "moe_router_fusion", "moe_use_legacy_grouped_gemm")


def _free_port() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def setup(seed: int = 1234) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_mtp.library.initialize import initialize_distributed, initialize_model_parallel

    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", _free_port())
        initialize_distributed(1, 1, None, seed)
    elif not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(1, 1, None, seed)


def check_buildable(args) -> None:
    """A checkpoint whose forward differs from what this module builds is refused in one line."""
    from megatron_mtp.arguments.checks import layers_needing_te

    pattern = getattr(args, "hybrid_layer_pattern", None) or ""
    others = layers_needing_te(pattern)
    if others:  # Mamba's state is not in the decoding cache, and the other layers need Transformer Engine
        raise ServingError(f"the checkpoint's HybridModel (--hybrid-layer-pattern {pattern}) has layers "
                           f"{' '.join(others)}, which this tool does not run: it runs attention '*', MLP '-', "
                           "MoE 'E' and Gated DeltaNet 'G'")
    for flag in UNSUPPORTED:
        if getattr(args, flag, None):
            raise ServingError(f"the checkpoint's model has --{flag.replace('_', '-')} {getattr(args, flag)}, "
                               "which this tool does not run")


def transformer_config(args, mtp_num_layers=None):
    """The TransformerConfig (MLATransformerConfig with multi-latent attention) the trainer builds
    from a checkpoint's arguments, by the trainer's own path (Megatron-LM's
    core_transformer_config_from_args), so that every architecture flag the trainer reads is read
    here too; arguments the checkpoint does not hold (an import's) take Megatron-LM's defaults.
    Then run as this module runs a model: one process, fp32, no CUDA kernels (ONE_PROCESS, the
    MoE kernels off), parameters created on the CPU, and `mtp_num_layers` depths if given."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments, core_transformer_config_from_args

    check_buildable(args)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    complete = parser.parse_args([])
    vars(complete).update(vars(args))
    vars(complete).update(ONE_PROCESS)
    vars(complete).update({name: False for name in MOE_KERNELS})
    vars(complete).update(use_cpu_initialization=True)
    if mtp_num_layers is not None:
        vars(complete).update(mtp_num_layers=mtp_num_layers or None)
    if not complete.mtp_num_layers:
        vars(complete).update(mtp_use_repeated_layer=False)
    return core_transformer_config_from_args(complete)


def build(args, mtp_num_layers=None, pg_collection=None):
    """GPTModel or HybridModel (TP = PP = EP = 1) of a checkpoint's arguments, built by the
    trainer's builders (megatron_mtp.library.model.build_gpt, build_hybrid) with the cached core
    attention; `setup()` first. `mtp_num_layers`: a GPTModel's depths, if not the checkpoint's (a
    HybridModel's are its pattern's). `pg_collection`: its process groups (default: megatron-core's
    parallel state; `own_groups()` for an engine beside a model-parallel trainer)."""
    from megatron_mtp.library.model import build_gpt, build_hybrid, gpt_options
    from megatron_mtp.serving.kv_cache import CachedSDPACoreAttention

    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        model = build_gpt(transformer_config(args, mtp_num_layers), args.padded_vocab_size,
                          args.max_position_embeddings, pre_process=True, post_process=True,
                          core_attention=CachedSDPACoreAttention, pg_collection=pg_collection, **gpt_options(args))
        return model.eval()
    if mtp_num_layers is not None and mtp_num_layers != (args.mtp_num_layers or 0):
        raise ServingError(f"a HybridModel's MTP depths are its pattern's ({pattern}): {mtp_num_layers} cannot be "
                           "built from it")
    # one process: the pipeline stages' layers ("|") in one stack
    model = build_hybrid(transformer_config(args), args.padded_vocab_size, args.max_position_embeddings,
                         pattern.replace("|", ""), pre_process=True, post_process=True, pg_collection=pg_collection,
                         core_attention=CachedSDPACoreAttention, **gpt_options(args))
    return model.eval()


def own_groups():
    """Process groups of this rank alone, every one of them: a model built with them runs in this
    process whatever the parallel state is (a rollout engine beside a trainer whose context-parallel
    ranks would otherwise cut its positions). A collective: every rank creates every rank's group."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection

    own = None
    for rank in range(dist.get_world_size()):
        group = dist.new_group([rank])
        own = group if rank == dist.get_rank() else own
    groups = ProcessGroupCollection()
    for name in (f.name for f in dataclasses.fields(groups)):
        setattr(groups, name, [own] if name == "hcp" else own)
    return groups


def sharded_metadata() -> dict:
    from megatron.core import parallel_state

    return {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def load(model, directory: str) -> None:
    """The model's tensors from a torch_dist checkpoint directory (any saved layout)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=sharded_metadata())}, directory)
    model.load_state_dict(loaded["model"], strict=False)


# Gated DeltaNet's tensors that upstream's sharded_state_dict saves section by section, a key each
# (`<name>.<section>`), in the module's order.
SECTIONS = {"self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
            "self_attention.conv1d.weight": ("query", "key", "value"),
            "self_attention.conv1d.bias": ("query", "key", "value")}


def local_names(global_tensors: dict, num_layers: int) -> dict:
    """A checkpoint's global tensors -> the model's state-dict names: stacked layers (a leading
    layer axis) and stacked experts (a leading expert axis) split, norms fused into the next
    linear (as Transformer Engine names them in checkpoints) named as the local layers do,
    Gated DeltaNet's sections joined."""
    renames = (("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
               ("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight"),
               ("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
               ("self_attention.linear_q_up_proj.layer_norm_weight", "self_attention.q_layernorm.weight"),
               ("self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.kv_layernorm.weight"))

    def rename(name):
        for old, new in renames:
            if name.endswith(old):
                name = name[: -len(old)] + new
        return name.replace(".transformer_layer.", ".mtp_model_layer.")

    out = {}
    for key, value in global_tensors.items():
        if key.startswith("decoder.layers.") and not key[len("decoder.layers."):].split(".")[0].isdigit():
            items = [(f"decoder.layers.{i}.{key[len('decoder.layers.'):]}", value[i]) for i in range(num_layers)]
        else:
            items = [(key, value)]
        for name, tensor in items:
            name = rename(name)
            if ".mlp.experts.experts." in name:
                for expert in range(tensor.shape[0]):
                    out[name.replace(".experts.experts.", f".experts.local_experts.{expert}.")] = tensor[expert]
            else:
                out[name] = tensor
    for name in [n for n in out if n.endswith(tuple(f"{base}.{parts[0]}" for base, parts in SECTIONS.items()))]:
        base = name.rsplit(".", 1)[0]
        parts = SECTIONS[next(b for b in SECTIONS if base.endswith(b))]
        out[base] = torch.cat([out.pop(f"{base}.{part}") for part in parts])
    return out


class Runner:
    """The main head and the MTP depths of a GPTModel or HybridModel, run separately over a KV cache.

    Each forward names the position of its first token: the main head and each depth keep the
    keys and values of the positions before it (`kv_cache.KVCache`), so a decoding step runs
    only its new positions, and a forward at an earlier position drops what came after it."""

    def __init__(self, model, vocab_size: int):
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
        from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

        from megatron_mtp.serving.kv_cache import CachedSDPACoreAttention, KVCache

        self.model = model
        self.vocab_size = vocab_size  # argmax over the tokenizer's ids, not the padding rows
        self.depths = model.config.mtp_num_layers or 0
        self.repeated = bool(model.config.mtp_use_repeated_layer)
        self.cache = KVCache()
        self.mla_ropes = []  # multi-latent attention's own rotary modules (`_positions`)
        for module in model.modules():
            if isinstance(module, CachedSDPACoreAttention):
                module.cache = self.cache
            if isinstance(module, MultiLatentAttention):
                self.mla_ropes.append(module.rotary_pos_emb)
            if isinstance(module, GatedDeltaNet):  # its convolution inputs and recurrent state in the cache
                module.forward = functools.partial(self.cache.gated_delta_net, module)
        # The decoder's last output before its final norm (main()'s h^0 is after it): what vLLM's MiMo MTP
        # drafts from (speculative.VllmDrafter)
        self.pre_norm = None
        norm = getattr(getattr(model, "decoder", None), "final_layernorm", None)
        if norm is not None:
            norm.register_forward_pre_hook(lambda module, args: setattr(self, "pre_norm", args[0]))

    def _output_weight(self):
        return self.model.shared_embedding_or_output_weight() if self.model.share_embeddings_and_output_weights \
            else None

    def _logits(self, hidden):  # [s, b, h] -> [b, s, V]
        logits, _ = self.model.output_layer(hidden, weight=self._output_weight())
        return logits.transpose(0, 1)[..., : self.vocab_size].float()

    def _rope(self, start: int, count: int):
        return self.model.rotary_pos_emb(start + count)[start:] if hasattr(self.model, "rotary_pos_emb") else None

    @contextlib.contextmanager
    def _positions(self, stream, start: int, count: int, keep: int = 0):
        """The cache's positions `start` on (`keep`: KVCache.positions'), and multi-latent attention's
        rotary positions with them: MLA computes its own rotary embedding from position 0 at every
        forward (the other attentions take `_rope`'s), so for this forward its rotary module counts
        from `start` (its `offset`)."""
        for rope in self.mla_ropes:
            rope.forward = functools.partial(type(rope).forward, rope, offset=start)
        try:
            with self.cache.positions(stream, start, count, keep):
                yield
        finally:
            for rope in self.mla_ropes:
                del rope.forward

    @torch.no_grad()
    def main(self, tokens: torch.Tensor, start: int = 0):
        """tokens [b, n] at positions start .. start + n - 1 -> (h^0 [n, b, h], logits [b, n, V])."""
        count = tokens.shape[1]
        positions = torch.arange(start, start + count).unsqueeze(0).expand_as(tokens)
        with self._positions("main", start, count):
            embedded = self.model.embedding(input_ids=tokens, position_ids=positions)
            hidden = self.model.decoder(hidden_states=embedded, attention_mask=None,
                                        rotary_pos_emb=self._rope(start, count))
        return hidden, self._logits(hidden)

    @torch.no_grad()
    def depth(self, k: int, hidden: torch.Tensor, ahead: torch.Tensor, start: int = 0, zero_position_0: bool = False):
        """Depth k (1-based) at positions t = start .. start + n - 1: h^{k-1}_t [n, b, h] and the tokens
        x_{t+k} [b, n] -> (h^k [n, b, h], logits^k [b, n, V]) predicting x_{t+k+1}. With
        `zero_position_0`, the token embedding at position 0 is zero (vLLM's MiMo MTP masks it there)."""
        layer = self.model.mtp.layers[0 if self.repeated else k - 1]
        embedding = self.model.embedding
        if zero_position_0 and start == 0:
            def embedding(input_ids, position_ids, _embed=self.model.embedding):
                embedded = _embed(input_ids=input_ids, position_ids=position_ids)  # [s, b, h]
                return torch.cat([torch.zeros_like(embedded[:1]), embedded[1:]])
        count = hidden.shape[0]
        positions = (torch.arange(start, start + count) + k).unsqueeze(0).expand_as(ahead)  # the rolled inputs'
        # depth k's next forward starts at its first position whose input x_{t+k} was a draft, up to
        # k - 1 before this one's end (speculative.Drafter): a Gated DeltaNet layer of its keeps the state there
        with self._positions(("depth", k), start, count, keep=k - 1):
            out = layer.forward_single_position(hidden_states=hidden, next_token_ids=ahead, position_ids=positions,
                                                embedding=embedding, rotary_pos_emb=self._rope(start, count))
        return out, self._logits(out)

    @torch.no_grad()
    def teacher_forced(self, tokens: torch.Tensor, depths: int | None = None):
        """Main logits and each depth's logits on a whole text, every depth fed the text's tokens."""
        hidden, main = self.main(tokens)
        per_depth = []
        length = tokens.shape[1]
        for k in range(1, (depths or self.depths) + 1):
            if length - k < 1:
                break
            hidden = hidden[: length - k]
            hidden, logits = self.depth(k, hidden, tokens[:, k:])
            per_depth.append(logits)
        return main, per_depth
