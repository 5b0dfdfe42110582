"""Model architectures: one module per architecture, pure functions of (weights, inputs, state).

Owns the math of each architecture and its decode state; never parses files (weights arrive
through a `weights.loader.WeightLoader`) and never touches token embeddings or the output head.
"""
