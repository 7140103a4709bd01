"""Program analysis, a library below the commands of tools/: what a compiled program holds and does
(program: collectives, memory, live buffers, saved residuals), what fills its peak (peak_memory), how
long it would take on its target (step_estimate) and the model's useful FLOPs (flops)."""
