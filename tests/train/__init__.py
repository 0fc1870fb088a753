"""Tests of training: the CLI, configuration, exact resume, crash safety, DDP."""
