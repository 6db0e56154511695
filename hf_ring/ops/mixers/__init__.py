"""Context-parallel forms of the token mixers of hybrid models (torch only, group passed in).

- ``conv``: the short depthwise causal convolution inside every mixer (halo of ``K - 1`` rows);
- ``delta``: the gated delta rules (Gated DeltaNet, KDA) by state passing;
- ``ssd``: Mamba2's SSD scan (a decay per head) by state passing, and a torch chunk scan;
- ``selective``: Mamba's selective scan (a decay per channel and state entry);
- ``lightning``: MiniMax's lightning attention (an SSD scan with step 1);
- ``diagonal``: a diagonal linear recurrence (RecurrentGemma's RG-LRU);
- ``runs``: a rank's runs stacked as a batch for a recurrence's kernel.

Each takes the batch's ``ShardLayout`` (through a plan made once per batch), runs the installed
kernel (or its torch fallback) on the local rows, and exchanges only borders and states.
"""
