"""Generation over a loaded model: `load.load_model` opens one, `session.Session` runs a
conversation's prefill → decode loop, `batch` decodes several sessions in one step.

Owns the loop and the token bookkeeping; it never parses files (the weights loader does) and never
knows which embedding or weights mode is active. Imports of this package load torch.
"""
