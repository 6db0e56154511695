"""A small byte-level BPE tokenizer trained here on RULER-like text (nothing is downloaded): a stand-in
for a model's tokenizer in the RULER tests, loadable with ``AutoTokenizer.from_pretrained``."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


@functools.cache
def tiny_tokenizer_dir(vocab_size: int = 1500) -> str:
    """A directory holding the tokenizer (``<s>`` BOS, ``</s>`` EOS), trained once per process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from hf_ring.evaluation import ruler_tasks as rt
    from hf_ring.evaluation.ruler_words import ADJECTIVES, NOUNS, VERBS

    corpus = [rt.NOISE, rt.NIAH_TEMPLATE, rt.NIAH_PREFIX, rt.NEEDLE, rt.VT_TEMPLATE, rt.VT_PREFIX, rt.CWE_TEMPLATE,
              rt.CWE_PREFIX, rt.FWE_TEMPLATE, rt.FWE_PREFIX, " ".join(ADJECTIVES), " ".join(NOUNS), " ".join(VERBS),
              " ".join(str(i) for i in range(1000))] * 4  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    from tokenizers.processors import TemplateProcessing

    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    path = Path(tempfile.mkdtemp(prefix="hf_ring_tok_"))
    fast.save_pretrained(path)
    return str(path)
