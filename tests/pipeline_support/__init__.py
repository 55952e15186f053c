"""Helpers for the pipeline tests: a step-by-step reference simulator and a torchrun worker."""
