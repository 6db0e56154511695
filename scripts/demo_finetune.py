"""The CPU demo's second stage, on every process of its launch (``scripts/demo.sh`` starts it while
the first stage trains):

    accelerate launch --config_file hf_ring/recipes/accelerate/cpu-4proc.yaml scripts/demo_finetune.py \\
        READY hf_ring/recipes/tiny-cpu-demo.yaml [--field value ...]

Each process starts Python and imports torch, transformers and the trainer (most of a process's
start-up) on the cores the one-process first stage leaves free (all but one), waits until the file
``READY`` exists (the first stage's model is saved), takes every core back, then runs the recipe
exactly as ``hf-ring train`` (``recipes/train.py``) does.
"""

import os
import sys
import time

WAIT_SECONDS = 3600  # the first stage takes about a minute; a launch left behind ends by itself

if __name__ == "__main__":
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores is not None and len(cores) > 1:  # leave one core to the first stage while importing
        os.sched_setaffinity(0, sorted(cores)[1:])
    import hf_ring.recipes.run  # noqa: F401  (torch, transformers, the trainer: the slow part of start-up)
    from hf_ring.cli import main

    ready, argv = sys.argv[1], sys.argv[2:]
    deadline = time.monotonic() + WAIT_SECONDS
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            sys.exit(f"demo_finetune: {ready} did not appear in {WAIT_SECONDS} s (the first stage did not finish)")
        time.sleep(0.1)
    if cores is not None:  # every thread, also any the imports started
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
            os.sched_setaffinity(int(tid), cores)
    sys.exit(main(["train", *argv]))
