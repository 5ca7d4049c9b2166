"""Workloads oomguard sizes and runs."""
