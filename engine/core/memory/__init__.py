"""What an out-of-memory error is, how memory is capped (budgets, the heap, the RAM guard), and what was held when one happened."""
