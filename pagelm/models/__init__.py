"""Model architectures: one module per architecture, pure functions of (weights, inputs, state).

Owns the math of each architecture and its decode state; never parses files (weights arrive
through `models.loading`) and never touches token embeddings or the output head.
"""
