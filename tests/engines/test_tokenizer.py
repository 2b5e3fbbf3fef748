"""The word-level tokenizer written beside a random model (what vLLM's own
benchmark client needs to make and count prompts): text made by `words`
reads back as exactly its token ids, in fewer characters per token than
the 5 vLLM allows a prompt's text before it tokenizes it."""

from __future__ import annotations

import random

from shmkv.engines.models import TIMING_MODEL, word, words, write_tokenizer


def test_words_read_back_as_their_token_ids(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(str(tmp_path), TIMING_MODEL.vocab_size)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    r = random.Random(3)
    ids = [r.randrange(3, TIMING_MODEL.vocab_size) for _ in range(4000)] + [3, TIMING_MODEL.vocab_size - 1]
    text = words(ids)
    assert tok(text).input_ids == ids, "no special token added, no word split"
    assert len(text) / len(ids) < 4, "vLLM refuses text longer than 5 characters a token of max_model_len"
    assert tok.decode(ids[:5]) == " ".join(text.split()[:5])
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert len({word(i) for i in range(TIMING_MODEL.vocab_size)}) == TIMING_MODEL.vocab_size
