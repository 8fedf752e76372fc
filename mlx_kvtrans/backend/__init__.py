"""Platform code: which BLAS MLX runs on, MLX's CPU buffer cache, and fast math on the CPU."""
