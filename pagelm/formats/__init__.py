"""Lean, read-only readers (and the matching writers) for model container files."""
