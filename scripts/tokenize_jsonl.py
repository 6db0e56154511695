"""Tokenise a JSON-lines file of documents for the recipes' ``data: {task: tokens}``.

    python scripts/tokenize_jsonl.py --tokenizer meta-llama/Llama-3.1-8B --field text docs.jsonl data/long-128k.jsonl

Each output line is ``{"input_ids": [...]}`` with the tokenizer's EOS token appended, so that
packed documents stay separated.
"""

import argparse
import json

from transformers import AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--field", default="text")
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    with open(args.src) as src, open(args.dst, "w") as dst:
        for line in src:
            ids = tok(json.loads(line)[args.field], add_special_tokens=True)["input_ids"]
            dst.write(json.dumps({"input_ids": [*ids, tok.eos_token_id]}) + "\n")


if __name__ == "__main__":
    main()
