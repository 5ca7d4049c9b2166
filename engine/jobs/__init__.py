"""Overnight jobs: job spec, data, size cache, journal, runner and its child processes."""
