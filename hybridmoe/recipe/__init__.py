"""A config resolved and validated: the recipe chain (named, YAML file or hf:DIR), key=value
overrides and the one validation pass over the whole config (every unmet requirement of every key
in one ConfigError)."""

from hybridmoe.recipe.load import load_config, recipe_names, split_args

__all__ = ["load_config", "recipe_names", "split_args"]
