"""Config: the typed tree (schema.py), its recipes (recipes/*.yml) and ConfigError.

Nothing here imports the rest of the package. Loading a recipe with overrides and the validation
pass over the whole config live above what they check, in hybridmoe/recipe/.
"""

from hybridmoe.config.errors import ConfigError
from hybridmoe.config.schema import Config

__all__ = ["Config", "ConfigError"]
