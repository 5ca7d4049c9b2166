"""Estimates: a workload's peak memory without running it (fake tensors, no weights)."""
