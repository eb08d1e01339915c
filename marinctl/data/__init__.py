"""Data: tokenized jagged stores, the built-in corpus, packing and mixtures (SPEC 6)."""
