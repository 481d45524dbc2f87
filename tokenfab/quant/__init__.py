"""Compressed weight formats executed packed: a Linear's weight kept in its published bytes and multiplied without a
full-size dequantized copy (:class:`~tokenfab.quant.packed_weight.PackedWeight`; GGUF block types in
``gguf_blocks`` / ``gguf_weight``)."""
