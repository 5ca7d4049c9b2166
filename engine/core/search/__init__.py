"""The search: trials, strategies, the memory fit, isolated runners, and the search loop."""
