"""Inference: params placed for decoding, the one decode stack (prefill and decode over a slot cache), the sampler."""
