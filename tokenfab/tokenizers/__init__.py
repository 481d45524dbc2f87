"""Tokenizers tokenfab implements itself, for checkpoint folders that transformers cannot load without running the
checkpoint's own Python code (``trust_remote_code``)."""
