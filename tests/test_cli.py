"""The commands as a user runs them: real output files, clear errors for bad input."""

from pathlib import Path

import numpy as np

from hybridmoe.cli import main

FIXTURE = Path(__file__).parent / "fixtures" / "hf_tiny"


def test_score_reproduces_the_reference_logprobs(tmp_path):
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", str(FIXTURE), "--tokens", str(FIXTURE / "tokens.npy"), "--out", str(out)]) == 0
    got, want = np.load(out), np.load(FIXTURE / "logprobs.npy")
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_score_rejects_out_of_vocab_tokens_without_writing(tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((1, 4), 10_000, np.int32))
    out = tmp_path / "lp.npy"
    assert main(["score", "--hf", str(FIXTURE), "--tokens", str(bad), "--out", str(out)]) == 2
    assert "--tokens" in capsys.readouterr().err
    assert not out.exists()


def test_unknown_word_is_refused(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["describe", "stray"])
