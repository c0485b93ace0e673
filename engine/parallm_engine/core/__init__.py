"""The request lifecycle: the engine thread, the scheduler's plan, sequences, results, stats."""
