"""Recipe entry point (configuration in the YAML, logic in hf_ring.recipes.run).

    accelerate launch --config_file recipes/accelerate/<launch>.yaml recipes/train.py hf_ring/recipes/<recipe>.yaml \\
        [--field value ...]   # any RingTrainingArguments field (--max_steps 4), or --data.seq_len 4096
"""

from hf_ring.recipes.run import main

if __name__ == "__main__":
    main()
