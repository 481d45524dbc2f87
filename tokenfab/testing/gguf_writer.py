"""Writing GGUF files as llama.cpp's converter lays them out, for tests and the GPU check's random-weight files
(tests/gguf_helpers.py, benchmarks/gpu_gguf.py): the model header from a Hugging Face config, and the closing
writes of a ``gguf.GGUFWriter``.
"""
from __future__ import annotations


def add_model_header(w, cfg: dict, rope_dimension_count: bool = False) -> None:
    """The hyperparameters of Hugging Face config ``cfg`` (hidden_size, intermediate_size, num_hidden_layers,
    attention heads, head_dim, rms_norm_eps, rope_parameters.rope_theta, vocab_size, bos / eos ids,
    max_position_embeddings) written into the ``gguf.GGUFWriter`` ``w`` as llama.cpp's converter writes them
    (llama adds the rope dimension count: ``rope_dimension_count``)."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if rope_dimension_count:
        w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def finish_gguf(w) -> None:
    """Write the header, key-values and tensors of the ``gguf.GGUFWriter`` ``w`` and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
