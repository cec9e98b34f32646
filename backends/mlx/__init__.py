"""The MLX family: mlx-lm's attention (`adapter.MlxBackend`), its caches (`decode`) and its layer (`layer`).

Nothing here imports MLX at module import; the adapter imports it when it runs.
"""
