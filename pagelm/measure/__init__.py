"""Measurements of a running process: memory from /proc. Never changes what it measures."""
