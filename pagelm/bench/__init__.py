"""`pagelm bench`: measured evidence that mapped embeddings change nothing a user sees but memory.

Drives real `pagelm serve` processes (or, for page-cache pressure, a model in process), prints
tables to stdout and progress to stderr. Benchmarks report numbers; they never assert them.
"""
