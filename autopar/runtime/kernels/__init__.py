"""Compute kernels the runtime forms call: each one a Triton kernel with a pure-PyTorch fallback."""

from autopar.runtime.kernels.block_attention import block_attention, block_attention_backward

__all__ = ["block_attention", "block_attention_backward"]
