"""Tokenizers tokenfab implements itself, for checkpoint folders that transformers cannot load without running the
checkpoint's own Python code (``trust_remote_code``): Kimi's ``tiktoken.model`` (tiktoken_tokenizer.py), and a
``tokenizer.json`` in a folder whose model_type transformers' AutoConfig does not know (hf_folder.py)."""
