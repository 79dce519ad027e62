"""Every tokenizer the recipes build decodes its own encoding back to the text (issue 17: the STARS demo's
character-level tokenizer used to decode ``1631`` as ``"1 6 3 1"``), also after save / ``AutoTokenizer`` load."""

import types

from transformers import AutoTokenizer

TEXT = "What is 512 + 1119?\nIt is 1631.  Done: (x, y) = [3, 4]!"


def _round_trip(tokenizer, tmp_path):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(TEXT, add_special_tokens=False)["input_ids"] == ids and loaded.decode(ids) == TEXT
    return ids


def test_stars_character_tokenizer(tmp_path):
    from recipes.stars_ouro import char_tokenizer

    tok = char_tokenizer()
    ids = _round_trip(tok, tmp_path)
    assert len(ids) == len(TEXT)  # one token per character
    assert tok.decode(tok.convert_tokens_to_ids(list("1631")) + [tok.eos_token_id], skip_special_tokens=True) == "1631"


def test_deq_lm_bpe_tokenizer(tmp_path):
    from recipes.train_deq_lm import train_tokenizer

    _round_trip(train_tokenizer("\n\n".join([TEXT] * 20 + ["the quick brown fox jumps over the lazy dog"] * 20),
                                vocab_size=300), tmp_path)


def test_attractor_lm_bpe_tokenizer(tmp_path):
    from recipes.attractor_lm import build_data

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join([TEXT] * 30 + ["the quick brown fox jumps over the lazy dog"] * 30))
    args = types.SimpleNamespace(dataset_name=None, corpus=str(corpus), max_chars=100_000, vocab_size=300,
                                 val_fraction=0.1)
    tokenizer, _, _ = build_data(args)
    _round_trip(tokenizer, tmp_path / "tok")
