"""What both loops (train/, rl/) share: set-up (mesh, sharded state, compiled step), the step, checkpoints,
the run directory and RunError, the numerics guard, metrics, Hugging Face import and export."""
