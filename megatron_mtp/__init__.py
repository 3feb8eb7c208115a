"""Megatron-MTP trainer package (fork-owned; megatron.core is the patched upstream)."""
