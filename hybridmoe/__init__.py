"""hybridmoe: a JAX trainer for Qwen3.5-family hybrid mixture-of-experts models."""

__version__ = "0.1.0"
