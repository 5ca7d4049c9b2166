"""The search core: OOM classification, budgets, trials, strategies, fit, runners, search,
retry policies and the executor. Imports nothing above it but the probes."""
