"""What both loops (train/, rl/) share: the run session (session.py: open or resume, the step loop's
bookkeeping, save on stop, export), set-up (mesh, sharded state, compiled step), the step, checkpoints,
the run directory and RunError, the numerics guard, metrics, Hugging Face import and export."""
