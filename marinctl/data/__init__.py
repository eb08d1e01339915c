"""Data: tokenized jagged stores, the built-in corpus, packing and mixtures (docs/recipe.md §6)."""
