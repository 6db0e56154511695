"""The recipe entry point of a source checkout, kept for existing command lines: the same as
``hf-ring train`` (``hf_ring.cli``), which an installed package has too.

    python recipes/train.py RECIPE [--field value ...]              # = hf-ring train RECIPE ...
    accelerate launch --config_file $(hf-ring train --config NAME) recipes/train.py RECIPE ...
"""

import sys

from hf_ring.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
