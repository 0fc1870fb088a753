"""The reliability suite at CI sizes: the same sections as `python -m bench.reliability`."""
