"""The tokenizers moved to the data layer (hybridmoe/data/tokenizer.py); this name stays importable."""

from hybridmoe.data.tokenizer import (  # noqa: F401
    BOS_ID, EOS_ID, PAD_ID, CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer)
