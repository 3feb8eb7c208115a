# Copyright (c) 2026, The Megatron-MTP authors. Licensed under the Apache License, Version 2.0 (LICENSE).
# Part of a modified NVIDIA megatron-core / Megatron-LM (Copyright (c) NVIDIA CORPORATION): see NOTICE.
"""A key/value cache for decoding with megatron-core's layers, in any process (no CUDA).

megatron-core's own caches do not fit speculative decoding here: the static inference
context turns the causal mask off for every forward after the prefill (it expects one new
token per step, where a verify step brings the accepted token and D drafts), and the dynamic
context allocates CUDA buffers. This cache sits in the layer spec instead: `CachedSDPACoreAttention`
is the serving model's `core_attention` (SDPACoreAttention, composed as the spec composes it);
it receives the new positions' keys and values (RoPE already applied by upstream's Attention)
and attends over the cached ones before them. SDPACoreAttention's causal mask aligns the
queries with the last keys, which is exactly "the new positions follow the cached ones".

A cache holds one stream per sequence of positions a model part runs over: the main head's,
and one per MTP depth (a repeated MTP layer runs at every depth with different inputs, so
streams are keyed by depth, not by module). A forward names the stream and the position its
first token has; the stream is cut back to that position first, which drops what a rejected
draft left behind. A Gated DeltaNet layer's entry (`recurrent.Entry`: its convolution's inputs
and its recurrent state at each position of the last forward) is cut back the same way: to the
state at that position, which the forward continues from.
"""

import contextlib

import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron.core.fork.runtime.sdpa_attention import SDPACoreAttention
from megatron_mtp.serving import recurrent


class KVCache:
    def __init__(self):
        self.entries = {}  # (stream, module id) -> (key, value), each [s, b, groups, d]
        self.lengths = {}  # stream -> positions held
        self.recurrent = {}  # (stream, module id) -> recurrent.Entry of a Gated DeltaNet layer
        self.recurrent_positions = {}  # stream -> positions run through Gated DeltaNet layers (a work count)
        self.stream, self.start = None, 0  # the stream of the forward under way (None: no caching), its start
        self.keep = 0  # of the forward under way: positions before its end the next one may start at

    @contextlib.contextmanager
    def positions(self, stream, start: int, count: int, keep: int = 0):
        """A forward of `stream` over positions start .. start + count - 1: what the stream held from
        `start` on is dropped first (a rejected draft's positions), the new ones are held after. The
        next forward of the stream starts at most `keep` positions before this one's end (a Gated
        DeltaNet layer keeps its state there; after a forward from a later position it holds every
        position's)."""
        held = self.lengths.get(stream, 0)
        if start > held:
            raise ValueError(f"KV cache stream {stream!r} holds {held} positions; a forward at {start} leaves a gap")
        entries = [entry for slot, entry in self.recurrent.items() if slot[0] == stream]
        for entry in entries:  # (before anything changes)
            entry.check(start)
        for entry in entries:
            entry.cut(start)
        for slot, (key, value) in list(self.entries.items()):  # also what a failed forward left
            if slot[0] == stream and key.shape[0] > start:
                self.entries[slot] = (key[:start], value[:start])
        self.lengths[stream] = start
        self.stream, self.start, self.keep = stream, start, keep
        try:
            yield
            self.lengths[stream] = start + count
        finally:
            self.stream = None

    def extend(self, module, key: torch.Tensor, value: torch.Tensor):
        """The module's cached keys and values of this stream with the new ones appended."""
        slot = (self.stream, id(module))
        if slot in self.entries:
            old_k, old_v = self.entries[slot]
            key, value = torch.cat([old_k, key]), torch.cat([old_v, value])
        self.entries[slot] = (key, value)
        return key, value


    def gated_delta_net(self, module, hidden_states, attention_mask=None, packed_seq_params=None, **_):
        """GatedDeltaNet's forward (the Runner puts this in its place) over this stream's positions,
        from the layer's state at the forward's start; without a stream, the module's own."""
        if self.stream is None:
            return type(module).forward(module, hidden_states, attention_mask, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError("the decoding cache serves causal, unpacked rows")
        entry = self.recurrent.setdefault((self.stream, id(module)), recurrent.Entry())
        entry.check(self.start)
        self.recurrent_positions[self.stream] = self.recurrent_positions.get(self.stream, 0) + hidden_states.shape[0]
        return recurrent.forward(module, entry, self.start, hidden_states, self.keep)


class CachedSDPACoreAttention(SDPACoreAttention):
    """SDPACoreAttention over the cached positions and the new ones, when a cache is attached and a
    stream is under way; otherwise SDPACoreAttention itself."""

    cache: KVCache | None = None  # attached by the serving model's Runner

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cache = self.cache
        if cache is not None and cache.stream is not None:
            if attention_mask is not None or packed_seq_params is not None:
                raise ValueError("the KV cache serves causal, unpacked rows")
            key, value = cache.extend(self, key, value)
            attn_mask_type = AttnMaskType.causal
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
