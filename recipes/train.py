"""Recipe entry point (configuration in the YAML, logic in hf_ring.train).

    accelerate launch --config_file recipes/accelerate/<launch>.yaml recipes/train.py hf_ring/recipes/<recipe>.yaml
"""

from hf_ring.train import main

if __name__ == "__main__":
    main()
