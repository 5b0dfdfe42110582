"""The chat layer: tokenizer, templates, reasoning split."""
