"""Compiled recipes compile each decoder layer once, whatever the lengths of the rows they meet: a recompilation per
new length (or past torch's recompile limit, an eager layer) made GPT-OSS-20B's first optimizer step take 370 s on an
H200. Each recipe trains its tiny model, compiled, through scripts/sft.py (in this process, with the environment
`accelerate launch` gives it) on rows of distinct lengths; the compiler's
own count of the graphs it built (torch._dynamo's counters, written to finetune_speed.json) must stay at the
recipe's constant. The backend is aot_eager: the graphs, guards and recompilations are dynamo's, whichever backend
then turns them into code, and inductor's C++ build would take minutes on a CPU. About 15 s per recipe."""

import json
import os
import random
import runpy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config

from tests.helpers import ROOT, printed_setup

pytestmark = pytest.mark.launches  # its tests start training processes

STEPS = 24
# What `accelerate launch` exports to its processes when the config file has no dynamo_config, as the shipped ones
ACCELERATE_LAUNCH_DYNAMO_ENV = {"ACCELERATE_DYNAMO_BACKEND": "NO", "ACCELERATE_DYNAMO_MODE": "default",
                                "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
                                "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False"}
WORDS = "red blue green cat dog tree hat sun moon star fish bird".split()


def write_chat_rows(folder, count: int = 2 * STEPS + 8) -> None:
    """Chat rows of 30 lengths (the tiny tokenizers spend about two tokens a word, plus ~40 for the template's
    header, whose date changes its length), all longer than half of max_length and shorter than it, so that a
    packing bin holds one row and batches of two rows take many lengths whatever the date."""
    rng = random.Random(0)
    folder.mkdir()
    for split, rows in (("train", count), ("test", 4)):
        with open(folder / f"{split}.jsonl", "w") as out:
            for index in range(rows):
                answer = " ".join(rng.choice(WORDS) for _ in range(50 + index % 30))
                question = " ".join(rng.choice(WORDS) for _ in range(3))
                out.write(json.dumps({"messages": [{"role": "user", "content": question},
                                                   {"role": "assistant", "content": answer}]}) + "\n")


# The graphs each recipe's compiled regions need: Llama's decoder layer's pieces around the CPU path's break (the
# block-diagonal attention) and the regions around the layers; GPT-OSS's one graph for both its layer types, its
# router logits captured without a break (finetune/patches.py, defer_output_capture: 7 graphs without it). Without
# the fix (static shapes, a first layer whose input does not require a gradient) Llama hits the recompile limit and
# GPT-OSS builds 26 graphs.
@pytest.mark.parametrize("recipe, graphs", [("llama-3.2-3b/lora.yaml", 10), ("gpt-oss-20b/lora.yaml", 1)])
def test_compiled_recipes_compile_once_for_rows_of_every_length(recipe, graphs, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    monkeypatch.setattr(functorch_config, "activation_memory_budget", functorch_config.activation_memory_budget)
    for name in list(os.environ):
        monkeypatch.setenv(name, os.environ[name])  # whatever the run sets in the environment is undone after it
    for name, value in ACCELERATE_LAUNCH_DYNAMO_ENV.items():
        monkeypatch.setenv(name, value)
    torch._dynamo.reset()
    counters.clear()
    write_chat_rows(tmp_path / "data")
    output_dir = tmp_path / "out"
    main = runpy.run_path(str(ROOT / "scripts" / "sft.py"))["main"]
    main(["--config", str(ROOT / "recipes" / recipe), "--tiny", "--dataset_name", str(tmp_path / "data"),
          "--max_length", "256", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
          "--max_steps", str(STEPS), "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no",
          "--torch_compile", "true", "--torch_compile_backend", "aot_eager", "--output_dir", str(output_dir)])
    torch._dynamo.reset()
    # the decoder layers are compiled, not the whole model (TRL's fused loss and its kernel launches recompiled per
    # length on the GPU)
    assert printed_setup(capfd.readouterr().out)["wrapper"] != "OptimizedModule"

    record = json.loads((output_dir / "finetune_speed.json").read_text())
    steps = record["step_log"]
    tokens_per_step = [after["num_tokens"] - before for before, after in
                       zip([0] + [step["num_tokens"] for step in steps], steps)]
    assert len(steps) == STEPS and len(set(tokens_per_step)) >= 20, tokens_per_step
    built = [step["compiled_graphs"] for step in steps]
    assert 0 < built[-1] <= graphs, built
    assert built[STEPS // 2] == built[-1], f"graphs were still being built after step {STEPS // 2}: {built}"
    # where the compiling went, phase by phase, for the first step's wait (dynamo's tracing is always one)
    assert record["compile_seconds"].get("_compile.compile_inner", 0) > 0, record["compile_seconds"]


def test_a_second_launch_loads_every_compiled_graph_from_the_cache(tmp_path, monkeypatch):
    """Two launches of the tiny compiled LoRA recipe on one machine, compiled by inductor (its C++ backend on a CPU):
    the second loads every graph from the compile cache folder and compiles none, by torch's own counters of its FX
    graph and AOTAutograd caches (finetune_speed.json): Inductor misses none, and AOTAutograd loads every graph the
    first launch stored and stores none. (Its remaining misses are the empty graphs dynamo leaves on each side of the
    CPU attention's graph break, which carry no code, are never compiled by Inductor and never stored by torch.)
    Each launch has a /tmp of its own: torch's default folder, had the cache folder been set after torch was
    imported, would differ between them. About 90 s on an idle machine."""
    from tests.helpers import launch_sft

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FINETUNE_COMPILE_CACHE", str(tmp_path / "compile-cache"))
    write_chat_rows(tmp_path / "data", count=8)
    caches = []
    for launch in ("first", "second"):
        (tmp_path / f"tmp-{launch}").mkdir()
        monkeypatch.setenv("TMPDIR", str(tmp_path / f"tmp-{launch}"))
        done = launch_sft("--config", str(ROOT / "recipes" / "llama-3.2-3b" / "lora.yaml"), "--tiny",
                          "--dataset_name", str(tmp_path / "data"), "--max_length", "256", "--max_steps", "2",
                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
                          "--torch_compile", "true", "--eval_strategy", "no", "--save_strategy", "no",
                          "--eval_samples_before_after", "0", "--output_dir", str(tmp_path / launch))
        assert done.returncode == 0, done.stderr[-3000:]
        caches.append(json.loads((tmp_path / launch / "finetune_speed.json").read_text())["compile_caches"])
    first, second = caches
    assert first["fxgraph_cache_miss"] > 0 and first["autograd_cache_miss"] > 0, first
    assert second["fxgraph_cache_miss"] == 0 and second["fxgraph_cache_hit"] >= first["fxgraph_cache_miss"], second
    assert first["autograd_cache_saved"] > 0 and second["autograd_cache_saved"] == 0, (first, second)
    assert second["autograd_cache_hit"] == first["autograd_cache_saved"], (first, second)
    assert not first["autograd_cache_bypass"] and not second["fxgraph_cache_bypass"], (first, second)
    assert (tmp_path / "compile-cache" / "inductor").is_dir()
