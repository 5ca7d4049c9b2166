"""oomguard's engine: decides and acts (OOM classification, budgets, search, executor)."""
