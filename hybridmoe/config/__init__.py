"""Config: the typed tree, recipes, overrides and the one validation pass."""

from hybridmoe.config.load import load_config, recipe_names, split_args
from hybridmoe.config.schema import Config
from hybridmoe.config.validate import ConfigError

__all__ = ["Config", "ConfigError", "load_config", "recipe_names", "split_args"]
