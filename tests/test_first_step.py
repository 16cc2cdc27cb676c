"""Time to the first step, the parts a CPU can show: DeepSpeed kept out of a run that does not use it, torch's
compile caches in a folder that outlives /tmp, the line that says the decoder layer compiles, and for how long, a run
too short to repay its compiling running eager, and no CPU vector probe in a compiled GPU run."""

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from tests.helpers import ROOT


def test_a_run_without_deepspeed_does_not_import_it_and_one_with_it_gets_it_back(monkeypatch):
    from accelerate.utils import is_deepspeed_available

    from finetune.patches import skip_unused_deepspeed as skip_deepspeed

    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    skip_deepspeed(SimpleNamespace(deepspeed=None))
    assert importlib.util.find_spec("deepspeed") is None and not is_deepspeed_available()
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    skip_deepspeed(SimpleNamespace(deepspeed=None))
    assert sys.modules.get("deepspeed", "absent") is not None


@pytest.mark.launches  # a fresh interpreter: this one imported transformers and peft long ago
def test_a_lora_run_imports_neither_bitsandbytes_nor_scikit_learn_nor_scipy(tmp_path):
    code = f"""
import sys
from finetune import run_folder, sft
imported = lambda: [name for name in ("bitsandbytes", "sklearn", "scipy") if sys.modules.get(name) is not None]
print("imported by finetune.sft:", imported())
run, trainer, tokenizer = sft.prepare(["--config", {str(ROOT / "recipes/llama-3.2-1b/lora.yaml")!r}, "--tiny",
                                       "--output_dir", {str(tmp_path / "out")!r}])
run_folder.release_lock(run.training.output_dir)
print("imported by the LoRA run:", imported(), type(trainer.model).__name__)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert "imported by finetune.sft: []" in result.stdout
    assert "imported by the LoRA run: [] PeftModelForCausalLM" in result.stdout  # data loaded, adapters in place


def test_bitsandbytes_stays_out_of_a_run_that_does_not_quantize_and_comes_back_for_one_that_does(monkeypatch):
    from peft.import_utils import is_bnb_available
    from transformers.utils.import_utils import is_bitsandbytes_available

    from finetune.patches import skip_unused_libraries

    unquantized = SimpleNamespace(load_in_4bit=False, load_in_8bit=False)
    monkeypatch.delitem(sys.modules, "bitsandbytes", raising=False)
    skip_unused_libraries(unquantized, SimpleNamespace(optim="adamw_torch_fused"))
    is_bnb_available.cache_clear()
    assert importlib.util.find_spec("bitsandbytes") is None and not is_bnb_available()  # peft's LoRA looks no further
    skip_unused_libraries(SimpleNamespace(load_in_4bit=True, load_in_8bit=False), SimpleNamespace(optim="adamw_torch"))
    assert is_bnb_available() and is_bitsandbytes_available()  # what peft and transformers cached is forgotten
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    skip_unused_libraries(unquantized, SimpleNamespace(optim="paged_adamw_32bit"))  # bitsandbytes' optimizers
    assert importlib.util.find_spec("bitsandbytes") is not None


def test_compile_caches_leave_tmp_for_the_finetune_folder_unless_the_user_chose_one(monkeypatch, tmp_path):
    from finetune import compile_cache

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "FINETUNE_COMPILE_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, "")  # restored afterwards to what it was, unset included
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert compile_cache.keep_compile_caches() == tmp_path / "home-cache" / "finetune" / "compile"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "home-cache" / "finetune" / "compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home-cache" / "finetune" / "compile" / "triton")

    import torch._inductor.runtime.cache_dir_utils as torch_cache_dirs  # torch's own default replaced, not kept

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_cache_dirs.default_cache_dir())
    monkeypatch.setenv("FINETUNE_COMPILE_CACHE", str(tmp_path / "moved"))
    compile_cache.keep_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "moved" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "home-cache" / "finetune" / "compile" / "triton")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own folder is kept
    compile_cache.keep_compile_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")

    compile_cache.keep_compile_caches(str(tmp_path / "flag"))  # the run's compile_cache_dir moves everything
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "flag" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "flag" / "triton")
    assert compile_cache.compile_cache() == tmp_path / "flag"


def test_a_compile_cache_folder_that_cannot_be_written_is_refused_when_named_and_given_up_when_the_default(
        monkeypatch, tmp_path, capfd):
    """torch creates its cache folder when its compiler is imported, and that import fails (a traceback before any
    run, compiled or not) where it cannot: an unwritable folder is never handed to torch. One the user named (the
    environment variable, the flag) refuses a compiled run before loading, as `finetune check` does; the default one
    (a read-only home) leaves the launch to torch's own folder, said in one line."""
    import torch._inductor.runtime.cache_dir_utils as torch_cache_dirs

    from finetune import compile_cache
    from finetune.commands.check import problems_before_loading
    from tests.helpers import run_sft_in_process

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FINETUNE_COMPILE_CACHE", str(a_file))
    compile_cache.keep_compile_caches()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and torch_cache_dirs.cache_dir()  # torch's /tmp default works
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")

    arguments = ["--config", str(ROOT / "recipes" / "llama-3.2-3b" / "lora.yaml"), "--tiny", "--torch_compile", "true",
                 "--output_dir", str(tmp_path / "out")]
    refused = run_sft_in_process(arguments, capfd, monkeypatch)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip() == (f"error: environment: FINETUNE_COMPILE_CACHE={a_file} names a compile cache folder "
                                   f"that cannot be written ({a_file}: a file, not a folder); point it at a writable "
                                   f"folder, or unset it to keep the caches in "
                                   f"{compile_cache.default_compile_cache()}.")
    assert [str(problem) for problem in problems_before_loading(arguments, 1)] == [refused.stderr.strip()[7:]]
    monkeypatch.delenv("FINETUNE_COMPILE_CACHE")
    flagged = [*arguments, "--compile_cache_dir", str(a_file / "under-a-file")]
    assert [str(problem) for problem in problems_before_loading(flagged, 1)] == [
        f"command line (--compile_cache_dir): `compile_cache_dir: {a_file / 'under-a-file'}` names a compile cache "
        f"folder that cannot be written ({a_file / 'under-a-file'}: Not a directory); point it at a writable folder, or "
        f"unset it to keep the caches in {compile_cache.default_compile_cache()}."]
    assert problems_before_loading([*arguments, "--compile_cache_dir", str(tmp_path / "writable")], 1) == []

    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))  # the default folder, in a home that cannot be written
    compile_cache.keep_compile_caches()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    capfd.readouterr()
    assert problems_before_loading(arguments, 1) == []
    assert capfd.readouterr().out.splitlines()[-1] == (
        f"[finetune] compile caches: {a_file}/finetune/compile cannot be written (Not a directory), so this launch "
        f"compiles into {torch_cache_dirs.default_cache_dir()}, which later launches reuse only until /tmp is emptied; "
        f"set FINETUNE_COMPILE_CACHE to a writable folder to keep them.")


def test_a_compile_cache_folder_that_fills_up_while_compiling_ends_in_one_sentence_with_the_fixes(tmp_path, capfd,
                                                                                                   monkeypatch):
    """The compiler writes its sources and libraries into the cache folder: a full disk there failed the first step
    with inductor's traceback of the C++ build. Raised here by a patched training step, in this process."""
    import runpy

    from torch._inductor.exc import CppCompileError, InductorError

    from finetune.compile_cache import inductor_cache
    from finetune.run.trainer import FinetuneTrainer

    def training_step(*args, **kwargs):
        raise InductorError(CppCompileError(["g++", "kernel.cpp"], "/usr/bin/ld: final link failed: No space left on "
                                                                   "device"), None)

    monkeypatch.setattr(FinetuneTrainer, "training_step", training_step)
    script = str(ROOT / "scripts" / "sft.py")
    monkeypatch.setattr(sys, "argv", [script, "--config", str(ROOT / "recipes" / "llama-3.2-3b" / "lora.yaml"),
                                      "--tiny", "--max_steps", "2", "--output_dir", str(tmp_path / "out"),
                                      "--eval_strategy", "no", "--save_strategy", "no",
                                      "--eval_samples_before_after", "0"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(script, run_name="__main__")
    err = capfd.readouterr().err
    assert exit.value.code == 2 and "Traceback" not in err, err
    assert (f"error: {inductor_cache()}: compiling could not write into the compile cache folder (no space left on "
            f"the device); free space there, move the caches with --compile_cache_dir, or run eager with "
            f"--torch_compile false.") in err


def test_the_compile_line_says_the_previous_launch_s_time(monkeypatch, tmp_path, capsys):
    from finetune.models import compilation

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = SimpleNamespace(config=SimpleNamespace(model_type="llama", hidden_size=3072, num_hidden_layers=28))
    args, state, control = None, TrainerState(), TrainerControl()
    first = compilation.CompileNotice(model, "LoRA", False, is_main_process=True)
    first.on_train_begin(args, state, control)
    assert "compiling the decoder layer once before the first step: a minute or more" in capsys.readouterr().out
    first.began -= 51  # the first step came 51 s after training began
    first.on_step_end(args, state, control)
    compilation.CompileNotice(model, "LoRA", False, is_main_process=True).on_train_begin(args, state, control)
    assert ("compiling the decoder layer once before the first step: about 51 s (the previous launch of llama "
            f"3072x28 LoRA on cpu, torch {torch.__version__})") in capsys.readouterr().out

    # the record is kept beside the caches it describes: the user's own inductor folder, empty, has none to read
    monkeypatch.setenv("FINETUNE_COMPILE_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compilation.CompileNotice(model, "LoRA", False, is_main_process=True).on_train_begin(args, state, control)
    assert f"a minute or more the first time; later launches reuse it from {tmp_path / 'mine'}\n" in \
        capsys.readouterr().out


def _gpu_run(recipe: str, *flags: str):
    """The recipe's run as parsed on a GPU machine: compiled as the recipe asks (a CPU turns it off)."""
    from finetune.run.arguments import parse_args

    run = parse_args(["--config", str(ROOT / "recipes" / recipe), "--tiny", *flags])
    if "torch_compile" not in run.flags:
        run.training.torch_compile = True
    return run


def test_a_run_too_short_to_repay_the_compile_runs_eager_and_says_why(monkeypatch, tmp_path, capsys):
    from finetune.models import compilation

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-cache"))
    smoke = _gpu_run("llama-3.2-3b/lora.yaml", "--max_steps", "10", "--max_length", "2048")
    capsys.readouterr()
    compilation.compile_only_if_it_pays(smoke, "meta-llama/Llama-3.2-3B-Instruct", rows=100_000)
    said = capsys.readouterr().out
    assert not smoke.training.torch_compile
    assert "running eager: compiling would not pay for itself in 10 steps (each of up to 32,768 tokens saves about " \
           "0.42 s, against ~11 s of compiling" in said and "`--torch_compile true` compiles anyway" in said

    # an epoch of 5,000 rows in steps of 8 x 2 rows: 313 steps of 0.42 s pay for 10.7 s of compiling
    long_run = _gpu_run("llama-3.2-3b/lora.yaml", "--max_length", "2048")
    compilation.compile_only_if_it_pays(long_run, "meta-llama/Llama-3.2-3B-Instruct", rows=5_000)
    assert long_run.training.torch_compile
    small_data = _gpu_run("llama-3.2-3b/lora.yaml", "--max_length", "2048")
    compilation.compile_only_if_it_pays(small_data, "meta-llama/Llama-3.2-3B-Instruct", rows=300)  # 19 steps: 8 s
    assert not small_data.training.torch_compile

    forced = _gpu_run("llama-3.2-3b/lora.yaml", "--max_steps", "10", "--torch_compile", "true")
    capsys.readouterr()
    compilation.compile_only_if_it_pays(forced, "meta-llama/Llama-3.2-3B-Instruct", rows=100_000)
    assert forced.training.torch_compile and capsys.readouterr().out == ""


def test_gpt_oss_120b_repays_its_compile_in_fewer_steps_than_20b_by_its_own_measured_speeds(monkeypatch, tmp_path,
                                                                                           capsys):
    """GPT-OSS-120B's entry (36 layers: 67.4 s of compiling, 4.5k tok/s eager against 6.9k compiled) saves 2.59 s a
    step of 32,768 tokens: 40 steps pay for it, where GPT-OSS-20B's figures (0.76 s a step against 42.6 s) would
    have run them eager; 20 steps do not."""
    from finetune.models import compilation

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-cache"))
    forty = _gpu_run("gpt-oss-120b/lora.yaml", "--max_steps", "40", "--max_length", "2048")
    compilation.compile_only_if_it_pays(forty, "openai/gpt-oss-120b", rows=100_000)
    assert forty.training.torch_compile
    twenty = _gpu_run("gpt-oss-120b/lora.yaml", "--max_steps", "20", "--max_length", "2048")
    capsys.readouterr()
    compilation.compile_only_if_it_pays(twenty, "openai/gpt-oss-120b", rows=100_000)
    assert not twenty.training.torch_compile
    assert "in 20 steps (each of up to 32,768 tokens saves about 2.59 s, against ~67 s of compiling" in \
        capsys.readouterr().out
    twenty_b = _gpu_run("gpt-oss-20b/lora.yaml", "--max_steps", "40", "--max_length", "2048",
                        "--gradient_checkpointing", "true")
    compilation.compile_only_if_it_pays(twenty_b, "openai/gpt-oss-20b", rows=100_000)
    assert not twenty_b.training.torch_compile


def test_a_short_run_compiles_where_this_machine_compiled_the_same_model_with_the_same_torch_before(monkeypatch,
                                                                                                   tmp_path):
    """The first step's record of this model's shape, method, device and torch says its graphs are in the caches;
    another size of the family (GPT-OSS-120B), another torch (whose cache keys differ) or checkpointing do not."""
    from finetune.families import load_architecture
    from finetune.models import compilation

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    records = tmp_path / compilation.FIRST_STEPS

    def short_run_compiles(record: str, *flags: str) -> bool:
        records.write_text(json.dumps({record: 95.0}))
        smoke = _gpu_run("gpt-oss-20b/lora.yaml", "--max_steps", "10", *flags)
        compilation.compile_only_if_it_pays(smoke, "openai/gpt-oss-20b", rows=100_000)
        return smoke.training.torch_compile

    twenty_b = compilation.first_step_key(load_architecture("openai/gpt-oss-20b"), "LoRA", False)
    assert short_run_compiles(twenty_b)
    assert not short_run_compiles(twenty_b, "--gradient_checkpointing", "true")  # other graphs: not compiled here
    assert not short_run_compiles(compilation.first_step_key(load_architecture("openai/gpt-oss-120b"), "LoRA", False))
    assert not short_run_compiles(twenty_b.replace(f"torch {torch.__version__}", "torch 2.12.0"))


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_on_a_gpu_a_compiled_run_skips_the_cpu_probe_and_starts_compile_workers_early(monkeypatch, gpu):
    from torch._inductor import config as inductor_config

    from finetune.models import compilation

    from torch._inductor import async_compile

    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", None)  # restored afterwards
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    workers_started = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: workers_started.append(True))
    compilation.prepare_process(SimpleNamespace(torch_compile=True, gradient_checkpointing=False))
    assert inductor_config.cpp.vec_isa_ok is (False if gpu else None)
    # and on a GPU inductor's Triton compile workers start before the model loads, not at the first kernel
    assert workers_started == ([True] if gpu else [])


def test_the_reasons_torch_gives_for_not_caching_a_graph_are_recorded_and_its_loggers_left_as_they_were(caplog):
    import logging

    from finetune.run.speed import CACHE_LOGGERS, CompileCacheEvents

    loggers = [logging.getLogger(name) for name in CACHE_LOGGERS]
    before = [(logger.level, list(logger.filters)) for logger in loggers]
    events = CompileCacheEvents()
    with caplog.at_level(logging.INFO, logger="torch"):  # a handler that takes everything the filter passes on
        loggers[1].info("Bypassing autograd cache due to: %s", "Unsupported call_function target foo")
        loggers[0].info("Bypassing FX Graph Cache because '%s'", "No shape env")
        loggers[0].info("FX graph cache hit for key %s", "abc")
    assert events.reasons == {"Bypassing autograd cache due to: Unsupported call_function target foo": 1,
                              "Bypassing FX Graph Cache because 'No shape env'": 1}
    assert not [record for record in caplog.records if record.name in CACHE_LOGGERS]  # below torch's own level
    events.close()
    assert [(logger.level, list(logger.filters)) for logger in loggers] == before


def test_a_compiled_layer_traces_its_floats_as_constants_without_restarting(monkeypatch):
    """Dynamo traced the layer's Python floats (attention scaling, epsilon, dropout) as symbols, failed to turn them
    into tensors and traced the whole layer a second time: 4 s of the 3B LoRA recipe's first step on an H100."""
    import logging

    from torch._dynamo import config as dynamo_config
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.models import compilation

    monkeypatch.setattr(dynamo_config, "specialize_float", dynamo_config.specialize_float)  # restored afterwards
    compilation.prepare_process(SimpleNamespace(torch_compile=True))
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1)
    model = LlamaForCausalLM(config).train()
    restarts = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: restarts.append(record.getMessage())
    logger = logging.getLogger("torch._dynamo.convert_frame")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch._dynamo.reset()
    try:
        model.model.layers[0].compile(backend="aot_eager", dynamic=True)  # the float pass is AOTAutograd's
        model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        torch._dynamo.reset()
    assert [message for message in restarts if "Restarting analysis" in message] == []
