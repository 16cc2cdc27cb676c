import importlib.util
import json
import re

import pytest
from trl.chat_template_utils import (
    get_training_chat_template,
    gptoss_chat_template,
    gptoss_training_chat_template,
    is_chat_template_stop_token_trained,
    llama3_2_chat_template,
)

from finetune.models.tiny import TINY_TOKENIZERS_DIR, build_tiny_tokenizer
from finetune.run.arguments import DEFAULT_ARGS
from tests.helpers import ROOT

SAMPLE_DIR = ROOT / "data" / "sample"
LLAMA_TRAINING_TEMPLATE = (ROOT / "finetune" / "chat_templates" / "llama3_2_training.jinja").read_text()

LLAMA_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
    "<|python_tag|>", "<|finetune_right_pad_id|>",
]
GPTOSS_SPECIALS = [
    "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
    "<|message|>", "<|call|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Count from 3 to 7."}, {"role": "assistant", "content": "3 4 5 6 7"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the opposite of hot?"},
        {"role": "assistant", "content": "cold"},
    ],
    [
        {"role": "user", "content": "Spell cat backwards."},
        {"role": "assistant", "content": "tac"},
        {"role": "user", "content": "Repeat: blue fish"},
        {"role": "assistant", "content": " blue fish\n"},  # the template trims content
    ],
    [{"role": "system", "content": "  Be concise.  "}, {"role": "user", "content": "Hi\n"}],
]


def read_jsonl(name):
    return [json.loads(line) for line in (SAMPLE_DIR / name).read_text().splitlines()]


@pytest.mark.parametrize(
    ("family", "specials", "bos", "eos", "pad"),
    [
        ("llama", LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>"),
        ("gpt-oss", GPTOSS_SPECIALS, "<|startoftext|>", "<|return|>", "<|endoftext|>"),
    ],
)
def test_tiny_tokenizer_carries_family_special_tokens_in_hub_roles(family, specials, bos, eos, pad):
    tok = build_tiny_tokenizer(family)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (bos, eos, pad)
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    added = {t.content: t for t in tok.added_tokens_decoder.values()}
    for special in specials:
        assert added[special].special, special
        # Each special must be one id, also when it appears inside text, or the chat format falls apart.
        assert tok.encode(f"a{special}b", add_special_tokens=False) == [
            *tok.encode("a", add_special_tokens=False),
            tok.convert_tokens_to_ids(special),
            *tok.encode("b", add_special_tokens=False),
        ]
    assert 900 <= len(tok) <= 1100


def test_tiny_tokenizer_files_are_small():
    for family in ("llama", "gpt-oss"):
        assert (TINY_TOKENIZERS_DIR / family / "tokenizer.json").stat().st_size < 100_000


def test_llama_tiny_tokenizer_renders_llama32_chat_format():
    tok = build_tiny_tokenizer("llama")
    assert tok.chat_template == llama3_2_chat_template
    text = tok.apply_chat_template(CONVERSATIONS[1], tokenize=False, date_string="26 Jul 2024")
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nAnswer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the opposite of hot?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\ncold<|eot_id|>"
    )
    prompt = tok.apply_chat_template(CONVERSATIONS[1][:-1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok.apply_chat_template(CONVERSATIONS[1], tokenize=True, return_dict=True)["input_ids"]
    # One bos, not two: the template writes it and apply_chat_template must not add another.
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[-1] == tok.eos_token_id


def test_llama_tiny_tokenizer_prepends_bos_on_plain_encode_like_llama3():
    tok = build_tiny_tokenizer("llama")
    assert tok("hello").input_ids[0] == tok.bos_token_id
    assert tok("hello", add_special_tokens=False).input_ids[0] != tok.bos_token_id


def test_gptoss_tiny_tokenizer_renders_harmony_chat_format():
    tok = build_tiny_tokenizer("gpt-oss")
    assert tok.chat_template == gptoss_chat_template
    text = tok.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n")
    assert text.endswith(
        "<|end|><|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n<|end|>"
        "<|start|>user<|message|>What is the opposite of hot?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>cold<|return|>"
    )
    ids = tok.apply_chat_template(CONVERSATIONS[1], tokenize=True, return_dict=True)["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert tok.bos_token_id not in ids  # harmony has no bos in the rendered conversation
    prompt = tok.apply_chat_template(CONVERSATIONS[1][:-1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|start|>assistant")


def test_gptoss_tiny_tokenizer_is_recognised_by_trl_training_template():
    tok = build_tiny_tokenizer("gpt-oss")
    training_template = get_training_chat_template(tok)
    assert training_template == gptoss_training_chat_template
    assert is_chat_template_stop_token_trained(tok, chat_template=training_template)
    out = tok.apply_chat_template(
        CONVERSATIONS[0], chat_template=training_template, return_assistant_tokens_mask=True, return_dict=True
    )
    masked = [i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(masked) == "<|start|>assistant<|channel|>final<|message|>3 4 5 6 7<|return|>"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_llama_training_template_renders_identically_to_llama32(conversation, add_generation_prompt):
    tok = build_tiny_tokenizer("llama")
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt, "date_string": "26 Jul 2024"}
    expected = tok.apply_chat_template(conversation, **kwargs)
    assert tok.apply_chat_template(conversation, chat_template=LLAMA_TRAINING_TEMPLATE, **kwargs) == expected


def test_llama_training_template_masks_assistant_content_and_eot():
    tok = build_tiny_tokenizer("llama")
    out = tok.apply_chat_template(
        CONVERSATIONS[2], chat_template=LLAMA_TRAINING_TEMPLATE, return_assistant_tokens_mask=True, return_dict=True
    )
    ids, mask = out["input_ids"], out["assistant_masks"]
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    expected = [
        *tok.encode("tac", add_special_tokens=False), eot, *tok.encode("blue fish", add_special_tokens=False), eot
    ]
    assert [i for i, m in zip(ids, mask) if m] == expected
    # The two spans end exactly on the assistants' <|eot_id|>, and nothing of the headers is trained.
    assert mask[-1] == 1
    assert sum(mask) == len(expected)
    assert is_chat_template_stop_token_trained(tok, chat_template=LLAMA_TRAINING_TEMPLATE)


@pytest.mark.parametrize("family", ["llama", "gpt-oss"])
@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "Zyxwvut qqq ñandú café naïve — “quotes” 日本語 한국어 🤗🚀",
        "def f(x):\n\treturn {'a': [1, 2, 3]}  # trailing  spaces  \n\n\r\n",
        "   leading spaces and 1234567890 digits",
        "\x00\x7f\u200b",
    ],
)
def test_tiny_tokenizer_round_trips_arbitrary_text(family, text):
    tok = build_tiny_tokenizer(family)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids) == text


def test_sample_dataset_rows_are_valid_conversations():
    train, test = read_jsonl("train.jsonl"), read_jsonl("test.jsonl")
    assert 350 <= len(train) <= 450 and 30 <= len(test) <= 50
    for row in train + test:
        assert list(row) == ["messages"]
        roles = [m["role"] for m in row["messages"]]
        assert roles in (["user", "assistant"], ["system", "user", "assistant"])
        for message in row["messages"]:
            assert set(message) == {"role", "content"}
            assert isinstance(message["content"], str) and message["content"].strip() == message["content"] != ""


def test_sample_dataset_answers_follow_from_prompts():
    for row in read_jsonl("train.jsonl") + read_jsonl("test.jsonl"):
        prompt, answer = row["messages"][-2]["content"], row["messages"][-1]["content"]
        if m := re.fullmatch(r"Repeat: (\w+ \w+)", prompt):
            assert answer == m[1]
        elif m := re.fullmatch(r"Reverse: (\w+) (\w+) (\w+)", prompt):
            assert answer == f"{m[3]} {m[2]} {m[1]}"
        elif m := re.fullmatch(r"Last word: \w+ \w+ (\w+)", prompt):
            assert answer == m[1]
        else:
            pytest.fail(f"prompt from no known game: {prompt!r}")


def test_sample_test_prompts_are_held_out_from_train():
    # Not only the rows: no held-out prompt is in the training rows with any system prompt, so scoring the test split
    # measures whether a game's rule was learned, not whether its answers were memorised.
    train_prompts = {row["messages"][-2]["content"] for row in read_jsonl("train.jsonl")}
    test_prompts = [row["messages"][-2]["content"] for row in read_jsonl("test.jsonl")]
    assert not train_prompts & set(test_prompts)
    games = {prompt.split(":")[0] for prompt in test_prompts}
    assert games == {"Repeat", "Reverse", "Last word"}, games
    default_sample_prompt = DEFAULT_ARGS[DEFAULT_ARGS.index("--sample_prompt") + 1]
    assert default_sample_prompt in test_prompts  # what the default run answers before and after is held out too


@pytest.mark.parametrize(("family", "limit"), [("llama", 64), ("gpt-oss", 110)])
def test_sample_rows_stay_short_with_the_chat_template(family, limit):
    # Both real templates prepend a fixed system preamble (about 25 Llama / 60 GPT-OSS tokens); the rest stays short.
    tok = build_tiny_tokenizer(family)
    for row in read_jsonl("train.jsonl") + read_jsonl("test.jsonl"):
        assert len(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]) <= limit


def test_build_script_reproduces_checked_in_assets(tmp_path):
    spec = importlib.util.spec_from_file_location("build_tiny_assets", ROOT / "scripts" / "build_tiny_assets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.ROOT = tmp_path
    script.main()
    for rel in [
        "data/sample/train.jsonl",
        "data/sample/test.jsonl",
        "finetune/tiny_tokenizers/llama/tokenizer.json",
        "finetune/tiny_tokenizers/gpt-oss/tokenizer.json",
    ]:
        assert (tmp_path / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
