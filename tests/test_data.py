"""Conversation loading, normalisation, loss masks on real chat templates, held-out split."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
from script_module import load_script

from eagle_infer.errors import UserError
from eagle_train.data import (
    DataWarning,
    load_conversations,
    normalize_conversation,
    render_prompt,
    render_with_loss_mask,
    split_heldout,
)

# Llama-3-Instruct's template (trims content, BOS first, <|eot_id|> ends every turn).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen3-style: the last assistant turn gets an empty think block, earlier ones do not, so a
# turn renders differently once the conversation goes on.
QWEN3_STYLE_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TWO_TURNS = [
    {"role": "user", "content": "question1"},
    {"role": "assistant", "content": "answer1"},
    {"role": "user", "content": "question2"},
    {"role": "assistant", "content": "answer2"},
]


@pytest.fixture(scope="module")
def tok(tokenizer):
    # conftest's session tokenizer of the default target (SmolLM2); tests below copy it
    # before changing anything.
    return tokenizer


@pytest.fixture(scope="module")
def sharegpt():
    # The whole 125 MB parse, once for this module.
    return load_conversations("sharegpt")


def masked_text(tokenizer, ids, mask):
    return tokenizer.decode([i for i, m in zip(ids, mask) if m])


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


# --- loading ------------------------------------------------------------------------------


def test_sharegpt_truncated_file_recovered(sharegpt):
    # 17,671 complete elements; 126 empty and 17 without an assistant turn are skipped.
    assert len(sharegpt) >= 17_500
    assert all(len(c) >= 1 for c in sharegpt)
    assert all(any(m["role"] == "assistant" for m in c) for c in sharegpt)
    assert {m["role"] for c in sharegpt for m in c} == {"system", "user", "assistant"}


def test_sharegpt_limit_stops_early():
    convs = load_conversations("sharegpt", limit=5)
    assert len(convs) == 5


def test_mtbench_dummy_and_questions():
    assert len(load_conversations("mtbench_dummy")) == 500
    questions = load_conversations("mtbench")
    # Questions are prompts: user turns only, never filtered for a missing assistant turn.
    assert len(questions) == 80
    assert all(len(q) == 2 and {m["role"] for m in q} == {"user"} for q in questions)


def test_normalize_sharegpt_form():
    record = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "h"},
            {"from": "gpt", "value": "g"},
            {"from": "bard", "value": "b"},
            {"role": "user", "content": "u"},
            {"from": "chatgpt", "value": "c", "role": None, "content": None},  # Arrow-unified row
        ],
    }
    assert normalize_conversation(record) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "h"},
        {"role": "assistant", "content": "g"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "c"},
    ]


def test_normalize_openai_form():
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    assert normalize_conversation(record) == record["messages"]


@pytest.mark.parametrize(
    "record, problem",
    [
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": 3}]}, "content is a int"),
        ({"messages": "hello"}, "expected a list"),
        ({"text": "hello"}, "no 'conversations'"),
        ({"messages": [{"content": "x"}]}, "no 'from' or 'role'"),
    ],
)
def test_normalize_rejects(record, problem):
    with pytest.raises(ValueError, match=problem):
        normalize_conversation(record)


def test_bad_jsonl_lines_skipped_with_line_numbers(tmp_path, capsys):
    good = json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
    path = tmp_path / "convs.jsonl"
    write_jsonl(path, [good, "", "{not json", good])
    with pytest.warns(DataWarning) as record:
        convs = load_conversations(str(path))
    assert len(convs) == 2
    messages = [str(w.message) for w in record]
    assert any(f"{path}:2:" in m and "empty" in m for m in messages)
    assert any(f"{path}:3:" in m and "malformed" in m for m in messages)
    assert "loaded 2 conversations" in capsys.readouterr().out


def test_conversation_without_assistant_skipped(tmp_path, capsys):
    path = tmp_path / "convs.json"
    path.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "only a question"}]},
                {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                {"conversations": []},
            ]
        )
    )
    convs = load_conversations(str(path))
    assert convs == [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    assert "no assistant turn: 1" in capsys.readouterr().out
    assert len(load_conversations(str(path), require_assistant=False)) == 2


def test_invalid_record_skipped_with_warning(tmp_path):
    path = tmp_path / "convs.jsonl"
    write_jsonl(
        path,
        [
            json.dumps({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}),
            json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}),
        ],
    )
    with pytest.warns(DataWarning, match=":1: message 0 has unknown role 'alien'"):
        assert len(load_conversations(str(path))) == 1


def test_truncated_json_array_recovered(tmp_path):
    conv = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path = tmp_path / "cut.json"
    path.write_text(json.dumps([conv, conv, conv])[:-30])
    with pytest.warns(DataWarning, match="truncated"):
        assert len(load_conversations(str(path))) == 2


def test_xz_files_read_like_plain_ones(tmp_path):
    """segment_prompts.py writes .jsonl.xz: every reader (datasets, the tolerant line reader,
    the truncated-array recovery) takes it compressed."""
    import lzma

    conv = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    line = json.dumps(conv)
    cases = {"clean.jsonl.xz": f"{line}\n{line}\n", "blank.jsonl.xz": f"{line}\n\n{line}\n",
             "cut.json.xz": json.dumps([conv, conv, conv])[:-30]}
    for name, text in cases.items():
        path = tmp_path / name
        with lzma.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DataWarning)  # the blank line and the cut
            assert len(load_conversations(str(path))) == 2, name


def test_missing_file_is_user_error(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="nope.jsonl"):
        load_conversations(str(missing))


# --- rendering ----------------------------------------------------------------------------


def test_loss_mask_smollm2_two_turns(tok):
    ids, mask = render_with_loss_mask(tok, TWO_TURNS)
    # Same tokens as the tokenizer's own chat-template tokenization.
    assert ids == tok.apply_chat_template(TWO_TURNS, tokenize=True, return_dict=False)
    assert len(mask) == len(ids)
    assert masked_text(tok, ids, mask) == "answer1<|im_end|>answer2<|im_end|>"
    # Neither the role header nor the newline after <|im_end|> is trained on.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    masked_ends = [i for i, (t, m) in enumerate(zip(ids, mask)) if t == im_end and m]
    assert len(masked_ends) == 2 and all(mask[i + 1] == 0 for i in masked_ends)
    assert mask[-1] == 0 and tok.decode(ids[-1:]) == "\n"


def test_loss_mask_llama3_template_with_system(tok):
    t = copy.deepcopy(tok)
    t.chat_template = LLAMA3_TEMPLATE
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    t.add_special_tokens({"additional_special_tokens": specials})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "question1"},
        {"role": "assistant", "content": "  answer1\n"},  # the template trims it
        {"role": "user", "content": "question2"},
        {"role": "assistant", "content": "answer2"},
    ]
    ids, mask = render_with_loss_mask(t, messages)
    assert "Be brief." in t.decode(ids)
    assert masked_text(t, ids, mask) == "answer1<|eot_id|>answer2<|eot_id|>"


def test_loss_mask_template_that_rerenders_earlier_turns(tok):
    t = copy.deepcopy(tok)
    t.chat_template = QWEN3_STYLE_TEMPLATE
    ids, mask = render_with_loss_mask(t, [{"role": "system", "content": "sys"}, *TWO_TURNS])
    assert "<think>" in t.decode(ids)  # only the last turn has it
    assert masked_text(t, ids, mask) == "answer1<|im_end|>answer2<|im_end|>"


def test_loss_mask_real_sharegpt_turns(tok, sharegpt):
    # Every assistant turn of real conversations (odd characters, empty turns, leading
    # assistant turns) gets exactly one masked end-of-turn token.
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for conv in sharegpt[:40]:
        ids, mask = render_with_loss_mask(tok, conv)
        n_assistant = sum(m["role"] == "assistant" for m in conv)
        assert sum(1 for t, m in zip(ids, mask) if m and t == im_end) == n_assistant
        assert sum(mask) >= n_assistant


def test_truncation_cuts_ids_and_mask(tok):
    full_ids, full_mask = render_with_loss_mask(tok, TWO_TURNS)
    ids, mask = render_with_loss_mask(tok, TWO_TURNS, max_length=len(full_ids) - 5)
    assert ids == full_ids[:-5] and mask == full_mask[:-5]


def test_render_prompt_is_prefix_for_regeneration(tok):
    full_ids, _ = render_with_loss_mask(tok, TWO_TURNS)
    prompt = render_prompt(tok, TWO_TURNS[:3])
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n")
    assert full_ids[: len(prompt)] == prompt


def test_render_rejects_bad_messages(tok):
    with pytest.raises(ValueError, match="message 0"):
        render_with_loss_mask(tok, [{"role": "bot", "content": "x"}])


# --- split --------------------------------------------------------------------------------


def test_split_heldout_deterministic_and_disjoint():
    convs = [[{"role": "user", "content": str(i)}] for i in range(100)]
    train, held = split_heldout(convs, 10, seed=0)
    train2, held2 = split_heldout(convs, 10, seed=0)
    assert (train, held) == (train2, held2)
    assert len(held) == 10 and len(train) == 90
    ids = lambda part: {c[0]["content"] for c in part}
    assert not ids(train) & ids(held) and len(ids(train) | ids(held)) == 100
    assert ids(split_heldout(convs, 10, seed=1)[1]) != ids(held)
    assert len(split_heldout(convs, 0.25, seed=0)[1]) == 25
    with pytest.raises(UserError, match="heldout"):
        split_heldout(convs, 100, seed=0)


def test_segment_prompts_interleave_spreads_each_source_evenly(tmp_path):
    """scripts/segment_prompts.py --mix: another file's prompts spread evenly among a segment's,
    each kind in its own order, so a capture cut short holds both in proportion; the file is read
    plain or xz'd."""
    import lzma

    mod = load_script("segment_prompts")
    assert mod.interleave(["a1", "a2", "a3", "a4"], ["b1", "b2"]) == ["a1", "b1", "a2", "a3", "b2", "a4"]
    assert mod.interleave([], ["b1"]) == ["b1"] and mod.interleave(["a1"], []) == ["a1"]
    mixed = mod.interleave(list(range(300)), [-i for i in range(1, 101)])
    for cut in (40, 120, 400):  # any prefix holds both in their 3:1 proportion, give or take one
        head = mixed[:cut]
        assert abs(sum(x >= 0 for x in head) - 0.75 * cut) <= 1
    assert [x for x in mixed if x >= 0] == list(range(300))
    records = [{"id": i, "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)]
    text = "".join(json.dumps(r) + "\n" for r in records) + "\n"
    (tmp_path / "p.jsonl").write_text(text)
    (tmp_path / "p.jsonl.xz").write_bytes(lzma.compress(text.encode()))
    assert mod.read_jsonl(tmp_path / "p.jsonl") == mod.read_jsonl(tmp_path / "p.jsonl.xz") == records
