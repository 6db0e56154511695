"""The ops: everything that computes, on torch alone.

Attention: block kernels (``kernels``, ``kernels_cpu``, ``kernels_cuda``, ``kernels_flash``; ``varlen``
batches a ring step's blocks), ring schedules as data (``schedule``) over the batch's ``layout``, the
ring communicator (``comm``), the one ring attention Function (``ring``; ``merge``: partial results in
log space, sinks; ``checks``: what the attention ops accept), sliding windows and chunked attention
(``windows``, with the halo ``exchange``), Ulysses (``ulysses``) and zigzag sharding (``zigzag``).
Token mixers of hybrid models: ``mixers`` over ``state_passing``. Losses and memory: the chunked
cross-entropy (``cross_entropy``, with ``tail``), the router loss (``router_loss``), ``reduce``, the
tiled MLP (``tiled_mlp``) and activation ``offload``.

Every module here imports only torch (``tests/test_layers.py`` reads the sources to hold that),
knows nothing of transformers, and keeps no process-wide state: the process group or communicator
is always an argument. docs/architecture.md maps each module.
"""
