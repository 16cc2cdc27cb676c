"""Build the offline assets of the tiny-model path: the sample dataset and the tiny tokenizers.

    python scripts/build_tiny_assets.py

Writes data/sample/{train,test}.jsonl and finetune/tiny_tokenizers/{llama,gpt-oss}/tokenizer.json. Seeded, so a rerun
reproduces the checked-in files byte for byte; rerun it only when the task or the tokenizer recipe changes.
"""

import itertools
import json
import random
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
SEED = 0
N_TRAIN = 400
HELD_OUT_PER_GAME = 14
VOCAB_SIZE = 1000  # including the special tokens, which sit after the learned vocabulary as in the real checkpoints

# The default run (`accelerate launch scripts/sft.py`) must visibly learn: a 2-layer random transformer (128 wide
# there; the tests' 64-wide one learns them from some random starts only), in about a minute on a CPU, goes from no
# correct held-out answer to most of them. So the tasks are three word games
# whose answers follow from the prompt by a rule (copy, reverse, pick the last word) over one small set of words, and
# the held-out prompts are word combinations that no training row contains: scoring them measures that the rule was
# learned, not that answers were memorised.
WORDS = ["cat", "dog", "sun", "map", "cup", "pen", "box", "hat", "bed", "car", "fish", "tree"]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Be concise."]

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
Our neighbours grow tomatoes, potatoes, carrots and onions, and they share the harvest with friends every autumn.
The committee reviewed the proposal carefully, asked several difficult questions, and finally approved the budget.
A journey of a thousand miles begins with a single step; patience, practice and curiosity carry you the rest of it.
Thunderstorms rolled across the valley overnight, flooding several roads and delaying the morning buses.
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
    """Every (prompt, answer) pair, grouped by game."""
    return {
        "repeat": [(f"Repeat: {a} {b}", f"{a} {b}") for a, b in itertools.permutations(WORDS, 2)],
        "reverse": [(f"Reverse: {' '.join(w)}", " ".join(reversed(w))) for w in itertools.permutations(WORDS, 3)],
        "last word": [(f"Last word: {' '.join(w)}", w[-1]) for w in itertools.permutations(WORDS, 3)],
    }


def conversation(prompt: str, answer: str, system: str | None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def build_dataset(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Hold out HELD_OUT_PER_GAME prompts of each game; each training row is a game drawn at random, then one of
    its other prompts (drawing prompts from all games at once would leave few rows to Repeat, which has fewest)."""
    systems = [None, None, *SYSTEM_PROMPTS]
    train_pairs, test = [], []
    for pairs in all_examples().values():
        rng.shuffle(pairs)
        test += [conversation(prompt, answer, rng.choice(systems)) for prompt, answer in pairs[:HELD_OUT_PER_GAME]]
        train_pairs.append(pairs[HELD_OUT_PER_GAME:])
    train = [conversation(*rng.choice(rng.choice(train_pairs)), rng.choice(systems)) for _ in range(N_TRAIN)]
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
