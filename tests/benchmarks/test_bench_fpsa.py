"""bench_fpsa on a tiny local BERT (``--model``): section (d)'s op counts and the --device check (no timing is
checked)."""

import pytest
from transformers import BertConfig, BertModel

from benchmarks.bench_fpsa import TEXT, main
from tests.helpers import train_bpe_tokenizer


@pytest.fixture()
def tiny_bert(tmp_path):
    tok = train_bpe_tokenizer([TEXT] * 4, vocab_size=300)
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=160, pad_token_id=tok.pad_token_id)
    BertModel(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_profile_counts_ops_and_host_reads(tiny_bert, capsys):
    main(["--model", tiny_bert, "--profile", "--batch-size", "2"])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        parts = line.split()
        if parts and parts[0] in ("BERT", "FPSA"):
            rows[line[4:36].strip()] = [float(x) for x in parts[-4:]]
    assert set(rows) == {"BERT", "FPSA tol 1e-3 cap 16 (default)", "FPSA tol 1e-3 cap 4"}
    bert, default, cap4 = rows["BERT"], rows["FPSA tol 1e-3 cap 16 (default)"], rows["FPSA tol 1e-3 cap 4"]
    # aten ops: the loop costs more than one attention step; the solve reads its convergence test back each step
    assert bert[0] < cap4[0] and bert[0] < default[0]
    assert cap4[1] >= 2 and cap4[3] <= 4
    assert bert[1] <= 1 and bert[3] == 1.0


def test_device_is_checked(tiny_bert):
    with pytest.raises(ValueError, match="--device 'tpu' is not a torch device"):
        main(["--model", tiny_bert, "--device", "tpu"])
    with pytest.raises(ValueError, match="--device 'meta': this benchmark runs on cpu or cuda"):
        main(["--model", tiny_bert, "--profile", "--device", "meta"])
    with pytest.raises(SystemExit):  # argparse: --profile and --dispatch each run instead of (a) and (b)
        main(["--model", tiny_bert, "--profile", "--dispatch"])
