"""Where models come from: the local store of named models (`store`), the Hugging Face Hub's names
and cache (`hub`), and the one directory both keep their own records in (`home`).

Owns names, downloads and paths; never opens a model for generation.
"""
