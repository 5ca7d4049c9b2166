"""The engine: decides and acts. ``core`` (search, executor), ``training`` (wrappers for
training scripts), ``jobs`` (overnight jobs) and ``cli``, layered in that order."""
