"""FR-Spec token maps and the EAGLE-3 draft vocabulary: counting, selection, file formats."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle_infer.errors import UserError
from eagle_train.tokenmap import (
    count_corpus,
    count_tokens,
    coverage,
    draft_vocab,
    frspec_token_map,
    load_token_map,
    mine_token_maps,
    save_token_map,
)

VOCAB = 16
EOS = 15
# id:      0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15
COUNTS = torch.tensor([9, 0, 4, 4, 7, 1, 0, 2, 0, 0, 3, 0, 0, 5, 0, 0])


def test_count_tokens_masks_and_sequences():
    seqs = [[1, 2, 2, 3], [3, 3]]
    masks = [[0, 1, 1, 0], [1, 0]]
    counts = count_tokens(seqs, masks, vocab_size=5)
    assert counts.dtype == torch.long and counts.tolist() == [0, 0, 2, 1, 0]
    # One sequence, a 2-D tensor and a generator all count the same way.
    assert count_tokens([1, 2, 2], vocab_size=5).tolist() == [0, 1, 2, 0, 0]
    assert count_tokens(torch.tensor([[1, 2], [2, 4]]), vocab_size=5).tolist() == [0, 1, 2, 0, 1]
    assert count_tokens((s for s in seqs), vocab_size=5).tolist() == [0, 1, 2, 3, 0]


def test_count_tokens_rejects_ids_outside_vocab():
    with pytest.raises(UserError, match="token id 7"):
        count_tokens([[1, 7]], vocab_size=5)
    with pytest.raises(ValueError, match="mask"):
        count_tokens([[1, 2]], [[1]], vocab_size=5)


def test_count_corpus_batches_texts():
    class CharTokenizer:  # one token per character, ids = ord - ord('a')
        def __len__(self):
            return 26

        def __call__(self, texts, add_special_tokens=False):
            assert add_special_tokens is False
            return {"input_ids": [[ord(ch) - ord("a") for ch in t] for t in texts]}

    counts = count_corpus(CharTokenizer(), ["abc", "aab", "c"], batch_size=2)
    assert counts[:4].tolist() == [3, 2, 2, 0] and int(counts.sum()) == 7


def test_frspec_map_order_size_and_eos():
    ids = frspec_token_map(COUNTS, 5, eos_token_ids=[EOS])
    assert len(ids) == 5
    assert EOS in ids  # never counted, forced in
    # Descending frequency, ties (ids 2 and 3 both 4) broken by the lower id.
    assert ids == [0, 4, 13, 2, EOS]
    freqs = COUNTS[torch.tensor(ids)].tolist()
    assert freqs == sorted(freqs, reverse=True)
    # Without EOS the next most frequent id takes the slot.
    assert frspec_token_map(COUNTS, 5, None) == [0, 4, 13, 2, 3]
    assert frspec_token_map(COUNTS, VOCAB, EOS) == sorted(range(VOCAB), key=lambda i: (-COUNTS[i], i))
    with pytest.raises(UserError, match="exceeds the vocabulary"):
        frspec_token_map(COUNTS, VOCAB + 1, EOS)


def test_token_map_file_format(tmp_path):
    ids = frspec_token_map(COUNTS, 6, EOS)
    path = tmp_path / "maps" / "frspec_6.pt"
    save_token_map(ids, path)
    raw = torch.load(path)
    # SGLang does torch.tensor(torch.load(path)): a plain list of Python ints.
    assert type(raw) is list and all(type(i) is int for i in raw) and raw == ids
    loaded = load_token_map(path, VOCAB)
    assert loaded.dtype == torch.long and loaded.tolist() == ids


@pytest.mark.parametrize(
    "content, problem",
    [
        ([0, 3, 16], "id 16 at position 2"),
        ([0, -1], "id -1 at position 1"),
        ([4, 2, 4], "id 4 appears more than once"),
        ([1, 2.5], "entry 1 is 2.5"),
        ({"ids": [1]}, "expected a list"),
        (torch.zeros(2, 2, dtype=torch.long), "1-D integer tensor"),
        ([], "is empty"),
    ],
)
def test_load_token_map_refuses_bad_maps(tmp_path, content, problem):
    path = tmp_path / "bad_map.pt"
    torch.save(content, path)
    with pytest.raises(UserError, match=problem) as err:
        load_token_map(path, VOCAB)
    assert "bad_map.pt" in str(err.value)


def test_load_token_map_missing_file(tmp_path):
    with pytest.raises(UserError, match="nothere.pt"):
        load_token_map(tmp_path / "nothere.pt", VOCAB)


def test_load_token_map_accepts_tensor(tmp_path):
    path = tmp_path / "t.pt"
    torch.save(torch.tensor([3, 1, 2], dtype=torch.int32), path)
    assert load_token_map(path, VOCAB).tolist() == [3, 1, 2]


def test_draft_vocab_semantics():
    d2t, t2d = draft_vocab(COUNTS, 5, EOS)
    assert d2t.dtype == torch.int64 and d2t.shape == (5,)
    assert t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    assert int(t2d.sum()) == 5
    target = torch.arange(5) + d2t  # target_id = draft_id + d2t[draft_id]
    assert target.tolist() == sorted(frspec_token_map(COUNTS, 5, EOS))  # draft ids sorted by target id
    assert bool(t2d[target].all()) and bool(t2d[EOS])
    assert not bool(t2d[1])  # never counted, not EOS


def test_coverage():
    total = int(COUNTS.sum())
    assert coverage(COUNTS, [0]) == pytest.approx(9 / total)
    assert coverage(COUNTS, list(range(VOCAB))) == pytest.approx(1.0)
    assert coverage(torch.zeros(4, dtype=torch.long), [0]) == 0.0


def test_mine_token_maps_writes_everything(tmp_path, capsys):
    summary = mine_token_maps(COUNTS, [4, 8, VOCAB, 32], tmp_path, "tiny-model", [EOS], draft_vocab_size=6)
    folder = tmp_path / "tiny-model"
    assert (folder / "frspec_4.pt").is_file() and (folder / "frspec_8.pt").is_file()
    assert not (folder / f"frspec_{VOCAB}.pt").exists() and not (folder / "frspec_32.pt").exists()
    assert summary["skipped_sizes"] == [VOCAB, 32]
    assert "skipped" in capsys.readouterr().out
    assert load_token_map(folder / "frspec_4.pt", VOCAB).tolist() == frspec_token_map(COUNTS, 4, EOS)
    tensors = load_file(str(folder / "d2t_t2d_6.safetensors"))
    assert set(tensors) == {"d2t", "t2d"}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert int(tensors["t2d"].sum()) == 6
    on_disk = json.loads((folder / "summary.json").read_text())
    assert on_disk == summary
    assert on_disk["coverage"]["4"] == pytest.approx(coverage(COUNTS, frspec_token_map(COUNTS, 4, EOS)))
    assert on_disk["coverage"]["4"] < on_disk["coverage"]["8"] <= 1.0
