"""Execution: the one size controller and retry loop, retry policies, the on_oom ladder, stats."""
