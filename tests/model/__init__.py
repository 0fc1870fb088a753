"""Tests of the model package: the GPT, checkpoints, converters, tokenizers, the CPU kernels."""
