"""Sampling settings, the batched sampler, logprobs, grammar constraints."""
