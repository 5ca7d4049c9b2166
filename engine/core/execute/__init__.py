"""Execution: the executor (one size controller, one retry loop), retry policies, on_oom, stats."""
