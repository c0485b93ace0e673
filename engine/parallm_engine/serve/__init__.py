"""Parallm serve: the OpenAI, Anthropic and Responses HTTP APIs."""
