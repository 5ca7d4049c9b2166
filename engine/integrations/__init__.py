"""Training frameworks adopting oomguard in one line: a transformers ``Trainer`` that sizes its
own micro-batch (:mod:`.hf_trainer`) and a Lightning callback (:mod:`.lightning_callback`).
Both search the framework's real training step (forward, backward, optimizer step) with the
model and optimizer restored after every trial, then keep the user's effective batch exactly
(:mod:`.sizing`). Importing this package imports neither framework."""
