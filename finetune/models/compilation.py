"""What `torch_compile: true` compiles, which of its dimensions may vary, and why it compiles once per region.

Each decoder layer is compiled once and the compiled code reused by every layer (not the whole model: minutes less
compiling; the LM head and the loss stay as TRL wrote them). A layer must then look the same to the compiler for every
batch and every layer, or it recompiles, and after `torch._dynamo.config.recompile_limit` (8) recompilations of one
frame it silently runs eagerly. On chat rows of varied length three things made it recompile (GPT-OSS-20B on an H200:
145 recompilations, the first optimizer step after 370 s):

- the sequence length (and the packed documents' count) differs from batch to batch: compiled with static shapes, every
  new length is a new graph. The layers are compiled with dynamic shapes from the start (`dynamic=True`), so one graph
  serves every length: no pass through static shapes first, as automatic dynamic shapes would take.
- with LoRA the embeddings are frozen, so the first layer's input does not require a gradient and every other layer's
  does: two graphs, and two of every graph after a break. The embedding output is made to require a gradient
  (`enable_input_require_grads`, as transformers does for checkpointed adapters): one extra input-gradient in the first
  layer's backward instead of a second compilation.
- a packed row's maximum document length reaches the attention as a Python int; compiled with dynamic shapes it is
  symbolic (finetune/models/attention.py takes it as it is, without reading it back from the GPU).
"""

import json
import math
import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import TrainerCallback

from finetune import patches
from finetune.compile_cache import inductor_cache, keep_compile_caches
from finetune.errors import say
from finetune.families import family_of, load_architecture
from finetune.json_files import read_object, write_atomically

DYNAMO_BACKEND_ENV = "ACCELERATE_DYNAMO_BACKEND"


FIRST_STEPS = "first_steps.json"  # seconds from training's start to the first step, per model, method and GPU


def prepare_process(training, cache_folder: str | None = None) -> None:
    """Before anything compiles: the compile caches are where `finetune` put them when it was imported
    (finetune/compile_cache.py), or in the run's `compile_cache_dir`; AOTAutograd's cache takes the graphs that hold
    this toolkit's autograd functions (patches.cache_graphs_with_custom_autograd_functions says why that is safe);
    Python floats are traced as the constants they are (patches.constant_float_inputs: no second trace); flex
    attention's block masks, which transformers compiles in eager runs too, compile once per mask type for every row
    length (patches.block_masks_compiled_for_every_length); on a GPU, inductor builds its few host-side kernels
    without probing the CPU first (patches.no_cpu_vector_probe), and its Triton compile workers start now, while the
    model loads, not at the first kernel (patches.compile_workers_started_early)."""
    if cache_folder:
        keep_compile_caches(cache_folder)
    patches.block_masks_compiled_for_every_length()
    if training.torch_compile:
        patches.cache_graphs_with_custom_autograd_functions()
        patches.constant_float_inputs()
        if torch.cuda.is_available():
            patches.no_cpu_vector_probe()
            patches.compile_workers_started_early()


@dataclass(frozen=True)
class CompileCost:
    """What compiling costs a recipe's first launch on a machine with empty caches, and what it saves per token."""
    compile_seconds: float
    eager_tokens_per_s: float
    compiled_tokens_per_s: float
    measured: str


# Measured (docs/benchmarks.md), by family, method, checkpointing and layers (None: any depth of the family without
# an entry of its own): the compiled recipes only.
COMPILE_COSTS = {
    ("llama", "LoRA", False, None): CompileCost(10.7, 19_501, 25_991, "Llama-3.2-3B LoRA: 10.7 s from training's "
                                                "start to the first step with empty caches on one H100 (2026-12-06), "
                                                "19.5k real tok/s eager and 26.0k compiled on chat rows (H200, "
                                                "2026-12-02)"),
    ("gpt-oss", "LoRA", True, None): CompileCost(42.6, 7_029, 8_399, "GPT-OSS-20B LoRA with checkpointing: 42.6 s "
                                                 "from training's start to the first step with empty caches on one "
                                                 "H100 (2026-12-06), 7.0k tok/s eager and 8.4k compiled (H200, "
                                                 "2026-12-03)"),
    ("gpt-oss", "LoRA", False, None): CompileCost(43.0, 12_681, 23_737, "GPT-OSS-20B LoRA: 43.0 s from training's "
                                                  "start to the first step with empty caches on one H100 (2026-12-06), "
                                                  "12.7k tok/s eager and 23.7k compiled (H200, 2026-12-02)"),
    ("gpt-oss", "LoRA", True, 36): CompileCost(67.4, 4_455, 6_877, "GPT-OSS-120B LoRA as its recipe ships: 67.4 s "
                                               "from training's start to the first step with empty caches, 4.5k real "
                                               "tok/s eager and 6.9k compiled on chat rows (one H100, 2026-12-06)"),
}


def compile_only_if_it_pays(run, model_path: str, rows: int) -> None:
    """A recipe's `torch_compile: true` compiles only where the run is long enough to win back the compiling: at
    most `rows` rows (packed bins hold one or more) in steps of at most batch x accumulation x max_length tokens, each
    saving the difference between the measured eager and compiled speeds. Compiled before on this machine (its
    caches warm: first_steps.json has the model), it compiles. `--torch_compile true` on the command line compiles
    whatever the length; `fp8` needs the compiler. One line says what was decided, with the figures."""
    training = run.training
    if not training.torch_compile or "torch_compile" in run.flags or run.finetune.fp8:
        return
    family, method = family_of(model_path).name, "LoRA" if run.model.use_peft else "full"
    cost = _compile_cost(family, method, bool(training.gradient_checkpointing), model_path)
    if cost is None or _compiled_here_before(model_path, method, training.gradient_checkpointing):
        return
    tokens_per_step = training.per_device_train_batch_size * training.gradient_accumulation_steps * \
        (training.max_length or 1024)
    steps = training.max_steps if training.max_steps > 0 else math.ceil(
        math.ceil(rows / (training.per_device_train_batch_size * max(run.launch.world_size, 1)))
        / training.gradient_accumulation_steps * training.num_train_epochs)
    saved_per_step = tokens_per_step * (1 / cost.eager_tokens_per_s - 1 / cost.compiled_tokens_per_s)
    if steps * saved_per_step >= cost.compile_seconds:
        return
    training.torch_compile, training.torch_compile_backend, training.torch_compile_mode = False, None, None
    say(f"running eager: compiling would not pay for itself in {steps} steps (each of up to {tokens_per_step:,} "
        f"tokens saves about {saved_per_step:.2f} s, against ~{cost.compile_seconds:.0f} s of compiling on a machine "
        f"that has not compiled it before; {cost.measured}); `--torch_compile true` compiles anyway.")


def _compile_cost(family: str, method: str, checkpointing: bool, model_path: str) -> CompileCost | None:
    """The entry for the model's depth where its family has one (its config read only then), else the family's."""
    depths = {key[3] for key in COMPILE_COSTS if key[:3] == (family, method, checkpointing)} - {None}
    if depths:
        try:
            layers = load_architecture(model_path).num_hidden_layers
        except (OSError, ValueError):  # no config.json to read offline: the family's figures
            layers = None
        if layers in depths:
            return COMPILE_COSTS[(family, method, checkpointing, layers)]
    return COMPILE_COSTS.get((family, method, checkpointing, None))


def _compiled_here_before(model_path: str, method: str, checkpointing: bool) -> bool:
    """Whether a compiled launch of this model (its shape), method, GPU and torch reached its first step on this
    machine (CompileNotice's record beside Inductor's caches): its graphs are then in the caches. Another size of
    the family, another GPU or another torch finds none of them there (torch's cache keys hold its version)."""
    try:
        config = load_architecture(model_path)
    except (OSError, ValueError):  # no config.json to read offline: counted as never compiled
        return False
    return first_step_key(config, method, checkpointing) in read_object(Path(inductor_cache()) / FIRST_STEPS)


def first_step_key(config, method: str, checkpointing: bool) -> str:
    """How first_steps.json names a compiled launch."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return (f"{config.model_type} {config.hidden_size}x{config.num_hidden_layers} {method}"
            f"{' checkpointed' if checkpointing else ''} on {device}, torch {torch.__version__}")


def compile_per_layer(training) -> list[TrainerCallback]:
    """Each decoder layer is compiled, once for all layers, and nothing else: the embeddings, the final norm, the
    rotary embedding and the LM head gain nothing from it and each took a graph of its own under accelerate's regional
    compilation (the embedding's never entered the compile caches: a second launch compiled it again). With
    checkpointing the compiler goes inside each layer's checkpoint: compiled around it, one graph break in the layer
    (GPT-OSS has some) makes dynamo run the whole checkpointed layer eagerly (pytorch#139989; GPT-OSS-20B on an H200:
    9.5k tok/s instead of 17.8k). The Trainer then compiles nothing and the returned callback does it, unless the
    accelerate config file asked for a dynamo backend of its own, whose dynamo_config then decides. Call before the
    trainer is built, and give it the returned callbacks: its accelerator reads the arguments then."""
    if not training.torch_compile or os.environ.get(DYNAMO_BACKEND_ENV, "NO").upper() != "NO":
        return []
    backend, mode = training.torch_compile_backend, training.torch_compile_mode
    training.torch_compile, training.torch_compile_backend, training.torch_compile_mode = False, None, None
    if training.gradient_checkpointing:
        return [CompileInsideCheckpoints(backend, mode, offloading=training.activation_offloading)]
    return [CompileEachLayer(backend, mode)]


def call(function, *args):
    return function(*args)


class CompileEachLayer(TrainerCallback):
    """Once the Trainer has prepared the model, each decoder layer is compiled in place with dynamic shapes (one
    graph for every row length and every layer). A model that captures outputs of the layers' modules (GPT-OSS's
    router logits for TRL's load-balancing loss) has each layer's forward run through one compiled function instead,
    so that, eagerly after each layer, the captured outputs go to transformers (patches.defer_output_capture)."""

    def __init__(self, backend: str | None, mode: str | None):
        self.backend, self.mode = backend or "inductor", mode

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        capturing = patches.defer_output_capture(model)
        if not capturing:
            for layer in patches.decoder_layers(model):
                layer.compile(backend=self.backend, mode=self.mode, dynamic=True)
            return
        compiled_call = torch.compile(call, backend=self.backend, mode=self.mode, dynamic=True)
        for layer, modules in zip(patches.decoder_layers(model), capturing):
            if "forward" not in vars(layer):
                layer.forward = partial(_compiled_forward, partial(patches.compiled_then_handed_over, compiled_call,
                                                                   modules), layer.forward)


def _compiled_forward(compiled_call, forward, *args, **kwargs):
    return compiled_call(partial(forward, **kwargs), *args)


class CompileInsideCheckpoints(TrainerCallback):
    """Once the Trainer has switched checkpointing on, every checkpointed layer runs checkpoint(compiled(layer))
    (finetune/patches.py: compile_inside_checkpoints); with `offloading`, TRL's activation offloading moves only
    the checkpoints' inputs to the CPU, not the layers recomputed in backward."""

    def __init__(self, backend: str | None, mode: str | None, offloading: bool = False):
        self.compiled_call = torch.compile(call, backend=backend or "inductor", mode=mode, dynamic=True)
        self.offloading = offloading

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        patches.compile_inside_checkpoints(model, self.compiled_call, self.offloading)


def one_graph_for_every_layer(model, compiled: bool) -> None:
    """Frozen embeddings (LoRA, QLoRA) give the first layer an input without a gradient and the others one with:
    the embedding output is made to require one, so that every layer's input looks the same to the compiler."""
    embeddings = model.get_input_embeddings()
    if compiled and not embeddings.weight.requires_grad and not getattr(model, "_require_grads_hook", None):
        model.enable_input_require_grads()


class CompileNotice(TrainerCallback):
    """Before the first step of a compiled run, one line that says the decoder layer compiles, and for how long the
    previous launch of this model, method and GPU took, instead of a progress bar that stands still; after it, that
    launch's time is kept for the next one (first_steps.json beside the caches it describes, in Inductor's folder)."""

    def __init__(self, model, method: str, checkpointing: bool, is_main_process: bool):
        self.key = first_step_key(model.config, method, checkpointing)
        self.path = Path(inductor_cache()) / FIRST_STEPS
        self.is_main_process = is_main_process
        self.began = None

    def _previous(self) -> dict:
        return read_object(self.path)

    def on_train_begin(self, args, state, control, **kwargs):
        self.began = time.time()
        seconds = self._previous().get(self.key)
        if seconds is None:
            say(f"compiling the decoder layer once before the first step: a minute or more the first time; later "
                f"launches reuse it from {inductor_cache()}")
        else:
            say(f"compiling the decoder layer once before the first step: about {seconds:.0f} s (the previous launch "
                f"of {self.key})")

    def on_step_end(self, args, state, control, **kwargs):
        if self.began is None or not self.is_main_process:
            return
        figures = {**self._previous(), self.key: round(time.time() - self.began, 1)}
        self.began = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, json.dumps(figures, indent=1) + "\n")  # two launches may end their step at once
        except OSError:
            pass  # a read-only home: the next launch says no figure, nothing else changes
