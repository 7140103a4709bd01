"""The data layer, below train/ and rl/: tokenizers, packing, and the sources of training rows and
prompts (synthetic, the built-in arithmetic tasks, JSONL/Parquet files)."""
