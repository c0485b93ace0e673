"""A model bigger than one machine: MLX's own ``mx.distributed`` under ``mlx.launch`` (docs/distributed.md)."""
