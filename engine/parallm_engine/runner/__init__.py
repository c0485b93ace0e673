"""Executing a step: forwards, the decode batch, per-backend kernels, LoRA in the batch."""
