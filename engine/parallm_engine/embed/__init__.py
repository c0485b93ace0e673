"""Embedding models and requests."""
