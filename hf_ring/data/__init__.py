"""Data: the DP x CP data-loader split, target counting, and the passkey task (torch only;
datasets-based documents and packing: ``hf_ring.recipes.data``)."""
