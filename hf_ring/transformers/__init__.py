"""The transformers glue: the only part of hf_ring that knows transformers."""
