"""Tests of the model package: the GPT, checkpoints, converters, tokenizers, the registry, the CPU kernels."""
