"""Data: the DP x CP data-loader split, target counting, and the passkey and text data sets."""
