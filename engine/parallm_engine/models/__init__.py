"""Finding and loading models: the hub, GGUF files, the local model store, adapters."""
