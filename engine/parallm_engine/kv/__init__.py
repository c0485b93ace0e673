"""KV memory: pages, the radix prefix tree, snapshots, quantized KV, the budget."""
