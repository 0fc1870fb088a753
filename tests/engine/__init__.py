"""Tests of the engine (model/engine/): parity with the naive loop, batching, admission, faults, caches."""
