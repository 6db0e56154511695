"""Context-parallel forms of the token mixers of hybrid models (torch only, group passed in).

- ``conv``: the short depthwise causal convolution inside every mixer (halo of ``K - 1`` rows);
- ``delta``: the gated delta rules (Gated DeltaNet, KDA) by state passing.

Each takes the batch's ``ShardLayout`` (through a plan made once per batch), runs the installed
kernel (or its torch fallback) on the local rows, and exchanges only borders and states.
"""
