"""Tests of the benchmarks' own arithmetic (what a benchmark reports must be computed right)."""
