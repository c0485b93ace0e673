"""Vision-language models: image inputs, the encoder worker, M-RoPE."""
