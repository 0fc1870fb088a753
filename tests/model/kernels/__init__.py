"""Tests of the CPU decode kernels (model/kernels/): their build, the module swaps, their products against torch
and float64 references in every variant this CPU runs (fixtures in tests/model/conftest.py, shared with quantize)."""
