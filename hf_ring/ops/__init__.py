"""The ops: block kernels, ring schedules, the ring communicator, the ring attention Function,
Ulysses head parallelism (all-to-all around the ring),
zigzag sharding, the chunked cross-entropy, the tiled MLP Function and activation offload.

Every module here imports only torch (``tests/test_layers.py`` reads the sources to hold that),
knows nothing of transformers, and keeps no process-wide state: the process group or communicator
is always an argument.
"""
