"""Speculative decoding (greedy and sampled), the sampling rule, and eval."""
