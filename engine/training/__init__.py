"""Inside training scripts: the decorator, the accelerate-shaped helper, exact gradient
accumulation and distributed agreement, all on the core's one size controller."""
