"""Tests of sampling and stopping: parameters, distributions, filters, stop strings."""
