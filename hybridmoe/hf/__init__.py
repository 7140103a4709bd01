"""Hugging Face checkpoints: config.json fields, weight names, safetensors files (a leaf: imports only config/)."""
