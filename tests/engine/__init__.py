"""Tests of the engine (model/engine/) against the naive reference loop: the same tokens alone, batched,
chunked, slid, stopped and failed; admission, cancellation, faults and caches."""
