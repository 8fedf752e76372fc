"""Tools beside the pipeline, each behind a `kvtrans` command: `verify` (capture, install and
replay are exact on a checkpoint), `doctor` (what MLX runs on here), `audit` (what a cache at rest
reveals of its tokens), `gguf` (a llama GGUF checkpoint as an mlx-lm model)."""
