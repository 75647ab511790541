"""The tests' own tiny models are built the way the examples build theirs: without transformers' config warnings."""

from _models import VOCAB, tiny_gpt2


def test_tiny_gpt2_special_tokens_lie_in_its_vocabulary():
    """GPT2Config's default bos/eos (50256) lie outside the 128-token vocabulary, and transformers warns
    about it at every build; the ids must be None or real tokens."""
    config = tiny_gpt2().config
    ids = {name: getattr(config, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert all(value is None or 0 <= value < VOCAB for value in ids.values()), ids
