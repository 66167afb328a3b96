import numpy as np
import pytest

from diloco.node.data.corpus import BatchSampler, embedded_corpus, load_corpus


def test_embedded_corpus_split_is_deterministic_and_disjoint() -> None:
    a, b = embedded_corpus(), embedded_corpus()
    assert len(a.train) > 1_000_000 and len(a.held_out) > 10_000
    assert np.array_equal(a.train[:1000], b.train[:1000]) and len(a.train) == len(b.train)
    assert a.vocab_size == 256


def test_sampler_resumes_exactly(tmp_path) -> None:
    tokens = np.arange(10_000, dtype=np.uint16)
    sampler = BatchSampler(tokens, batch_size=3, seq_len=8, seed=7)
    sampler.next_batch()
    state = sampler.state_dict()
    expected = [sampler.next_batch() for _ in range(3)]
    resumed = BatchSampler(tokens, batch_size=3, seq_len=8, seed=999)
    resumed.load_state_dict(state)
    for (x, y), (rx, ry) in zip(expected, (resumed.next_batch() for _ in range(3)), strict=True):
        assert (x == rx).all() and (y == ry).all()
    x, y = expected[0]
    assert x.shape == (3, 8) and (y[:, :-1] == x[:, 1:]).all()


def test_load_corpus_token_files_and_text(tmp_path) -> None:
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "val.bin")
    corpus = load_corpus(tmp_path)
    assert len(corpus.train) == 5000 and int(corpus.held_out[-1]) == 499
    text = tmp_path / "t.txt"
    text.write_bytes(b"hello world " * 1000)
    assert len(load_corpus(text).train) == 12000 * 19 // 20
    with pytest.raises(FileNotFoundError):
        load_corpus(tmp_path / "missing")
