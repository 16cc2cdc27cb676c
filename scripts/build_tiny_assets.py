"""Build the offline assets of the tiny-model path: the sample dataset and the tiny tokenizers.

    python scripts/build_tiny_assets.py

Writes data/sample/{train,test}.jsonl and finetune/tiny_tokenizers/{llama,gpt-oss}/tokenizer.json. Seeded, so a rerun
reproduces the checked-in files byte for byte; rerun it only when the task or the tokenizer recipe changes.
"""

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
N_TRAIN, N_TEST = 400, 40
VOCAB_SIZE = 1000  # including the special tokens, which sit after the learned vocabulary as in the real checkpoints

# The task has to be learnable by a 2-layer, 64-wide random transformer in about a minute on a CPU, so every answer
# is short and fully determined by the prompt.
OPPOSITES = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"), ("open", "closed"),
    ("happy", "sad"), ("light", "dark"), ("old", "new"), ("yes", "no"), ("in", "out"), ("left", "right"),
    ("early", "late"), ("full", "empty"), ("hard", "soft"), ("wet", "dry"), ("rich", "poor"), ("loud", "quiet"),
    ("tall", "short"), ("win", "lose"),
]
WORDS = [
    "cat", "dog", "sun", "map", "cup", "pen", "box", "hat", "bed", "car", "fish", "tree", "bird", "milk", "rain",
    "star", "frog", "book", "lamp", "ship", "moon", "door", "king", "rose", "wolf", "cake", "desk", "leaf", "ring",
    "bell",
]
COLORS = ["red", "blue", "green", "black", "white", "pink", "gray", "gold"]
NOUNS = ["fish", "car", "hat", "bird", "cup", "tree", "door", "ship", "box", "star"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Be concise."]
HELD_OUT_SYSTEM_PROMPT = "Answer briefly."

# Real-looking prose, so that arbitrary English still encodes in reasonably few tokens.
GENERIC_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A model is trained on data and then evaluated on held-out examples.
Fine-tuning adapts a pretrained language model to a new task with a small learning rate and a few thousand steps.
Please write a short answer. What time is it? It is a sunny morning, and the people in the city are going to work.
They said that we would meet at the station at half past nine, but the train was late because of the weather.
Every morning she walked along the river to the old market, where farmers sold bread, cheese, apples and flowers.
In the evening the children played games in the garden while their parents cooked dinner and talked about the news.
Scientists measure temperature, pressure and distance; engineers build bridges, machines, computers and networks.
If you have any questions about your account, contact our support team by email or telephone during office hours.
The history of the region includes long winters, short summers, several wars, and a famous library of ancient books.
Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 100 and 2024 appear in text.
So do symbols: ()[]{}<>/\\=+-*&%$#@!?;:'"`~^|.
def main():
    print("hello, world")
    return 0
"""
# The text the two chat templates wrap around every conversation, weighted like the rows it wraps, so that it
# becomes a few whole-word tokens instead of dominating the rows' length.
TEMPLATE_TEXT = """\
Cutting Knowledge Date: December 2023
Today Date: 26 Jul 2024

You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2025-08-05

Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
# Instructions

system
user
assistant
developer
final
analysis
commentary
"""

SPECIAL_TOKENS = {
    "llama": [
        "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
        "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>",
    ],
    "gpt-oss": [
        "<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
        "<|message|>", "<|call|>",
    ],
}

# The families' own pre-tokenizer regexes (Llama 3's and o200k's), so words, digits and newlines split where the
# real tokenizers split them; in particular "\n\n" before an assistant answer never merges into the answer.
SPLIT_PATTERNS = {
    "llama": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+"
    ),
    "gpt-oss": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


def all_examples() -> dict[str, list[tuple[str, str]]]:
    """Every (prompt, answer) pair, grouped by template."""
    return {
        "count": [
            (f"Count from {a} to {a + n - 1}.", " ".join(str(i) for i in range(a, a + n)))
            for a in range(1, 21)
            for n in range(3, 7)
        ],
        "opposite": [(f"What is the opposite of {a}?", b) for x, y in OPPOSITES for a, b in ((x, y), (y, x))],
        "reverse": [(f"Spell {w} backwards.", w[::-1]) for w in WORDS],
        "repeat": [(f"Repeat: {c} {n}", f"{c} {n}") for c in COLORS for n in NOUNS],
    }


def conversation(prompt: str, answer: str, system: str | None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def build_dataset(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Split each template's pairs so that no test conversation appears in train.

    Count, reverse and repeat hold out whole prompts (count and repeat can be got right by generalising). Opposites
    can only be memorised, so their test rows reuse train pairs and hold out the combination with a system prompt.
    """
    per_template = N_TEST // 4
    train_pairs, test, memorised = [], [], set()
    for name, pairs in all_examples().items():
        rng.shuffle(pairs)
        held_out = pairs[:per_template]
        if name == "opposite":
            train_pairs += pairs
            memorised.update(prompt for prompt, _ in held_out)
            test += [conversation(p, a, HELD_OUT_SYSTEM_PROMPT) for p, a in held_out]
        else:
            train_pairs += pairs[per_template:]
            test += [conversation(p, a, rng.choice([None, None, *SYSTEM_PROMPTS])) for p, a in held_out]
    train = []
    while len(train) < N_TRAIN:
        prompt, answer = rng.choice(train_pairs)
        systems = [None, None, None, *SYSTEM_PROMPTS]
        if prompt not in memorised:
            systems.append(HELD_OUT_SYSTEM_PROMPT)
        train.append(conversation(prompt, answer, rng.choice(systems)))
    rng.shuffle(test)
    return train, test


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def build_tokenizer(family: str, corpus: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERNS[family]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS[family]
    # The whole byte alphabet is in the vocabulary, so no text is ever unknown.
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if family == "llama":
        # Llama 3's tokenizer prepends <|begin_of_text|> on plain encode; GPT-OSS's prepends nothing.
        bos = "<|begin_of_text|>"
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def main() -> None:
    rng = random.Random(SEED)
    train, test = build_dataset(rng)
    write_jsonl(ROOT / "data/sample/train.jsonl", train)
    write_jsonl(ROOT / "data/sample/test.jsonl", test)

    # Test rows stay out of the tokenizer's corpus too, so that held-out answers are not whole tokens.
    texts = [m["content"] for row in train for m in row["messages"]]
    corpus = texts + [GENERIC_ENGLISH] + [TEMPLATE_TEXT] * len(train)
    for family in SPECIAL_TOKENS:
        out = ROOT / "finetune/tiny_tokenizers" / family / "tokenizer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        build_tokenizer(family, corpus).save(str(out), pretty=False)
        print(f"wrote {out.relative_to(ROOT)} ({out.stat().st_size} bytes)")
    print(f"wrote data/sample: {len(train)} train rows, {len(test)} test rows")


if __name__ == "__main__":
    main()
