"""Every change this toolkit makes to another library's private behaviour, and every private API it reads, in one
place.

Most are small functions here, each called from one visible spot; an entry that names another module says where the
private API is used instead. None runs at import. When a library fixes the problem or renames what is used, this list
says what to revisit and which test fails first.

- `FinetuneTrainer._save_checkpoint` (finetune/run/trainer.py, the one override of a private Trainer method)
  does: runs the Trainer's save, then flushes it and writes the completeness marker; save errors become one sentence.
  why: a kill mid-save leaves a folder that looks like a complete checkpoint.
  targets: transformers 5.17-5.24 `Trainer._save_checkpoint(model, trial)`.
  guarded by: tests/test_preemption_single.py, tests/test_preemption_ddp.py, tests/test_preemption_zero3.py.
- `rotation_deferred`
  does: makes `transformers.trainer.rotate_checkpoints` a no-op during one save; `checkpoints.rotate` runs after.
  why: the Trainer rotates before our marker exists and could delete the only complete checkpoint.
  targets: transformers 5.17-5.24 (module-level `rotate_checkpoints`).
  guarded by: test_preemption_single.py::test_save_total_limit_one_never_leaves_no_complete_checkpoint.
- `compile_inside_checkpoints`
  does: sets each layer's `_gradient_checkpointing_func` so that it runs checkpoint(compiled(layer)); with activation
  offloading, the layer's recomputation in backward runs under saved-tensor hooks that keep each tensor where it is
  (packed detached: an output saved with its history would keep its graph alive in a cycle).
  The checkpoint's first pass (no gradients) runs under `torch.enable_grad()` and returns its outputs detached
  (`_with_gradients_detached`), the outputs its modules captured handed over detached: its graph is the
  recomputation's, one graph per layer type instead of two (GPT-OSS-20B on one H100: 15.4 s of compiling cold).
  why: compiled around a checkpoint, one graph break makes dynamo run the whole layer eagerly. The checkpoint is
  reentrant, and TRL's offloading hooks stay active through the backward: without hooks of its own, every tensor the
  recomputed layer saves would be copied to the CPU and straight back.
  upstream: pytorch/pytorch#139989.
  targets: `GradientCheckpointingLayer` of transformers 5.17 (checkpoint in `__call__`) and 5.24 (in `forward`);
  trl 1.16 `OffloadActivations` (saved-tensor hooks around `training_step`, forward and backward).
  guarded by: test_train.py::test_under_checkpointing_a_layer_with_a_graph_break_is_still_compiled_once_for_all_layers,
  test_train.py::test_offloading_compiled_checkpoints_moves_only_layer_inputs_and_keeps_the_gradients,
  test_compiled_output_capture.py::test_a_checkpoints_first_pass_runs_the_graph_with_gradients_and_keeps_nothing_of_it
  and test_compiled_output_capture.py::test_compiled_gpt_oss_layers_capture_router_logits_without_a_graph_break (one
  graph per layer type inside checkpoints).
- `defer_output_capture`, `compiled_then_handed_over`
  does: where the model is set to return outputs its layers record (GPT-OSS's router logits: TRL turns on the MoE
  load-balancing loss through `output_router_logits`), installs transformers' output-capturing forward hooks at once
  (`maybe_install_capturing_hooks`), takes them out of each decoder layer's modules (`nn.Module._forward_hooks`; the
  hooks are found by their function's module and name) and puts one shared hook in their place: run by compiled code
  it only stashes the module's inputs and output on the module, run eagerly it calls transformers' hooks. After each
  compiled layer call, eagerly, `compiled_then_handed_over` gives the stashes to transformers' hooks, children before
  parents (the order their forwards end), so the collector gets the same tensors in the same order as without
  compiling. Inside a reentrant checkpoint, the first pass hands transformers leaves that require a gradient and
  the recomputation sends the gradients they received into its own captured outputs (an identity autograd function
  on the layer output), so TRL's load-balancing loss trains as under transformers' default non-reentrant
  checkpointing; it relies on autograd running the loss's nodes, built after every layer, before the layers'
  checkpoints (the engine runs the ready node created last first).
  why: transformers' hooks read a `ContextVar` (`_active_collector.get()`), which dynamo cannot trace: every
  GPT-OSS layer broke into about ten frames (20 graphs, ~100 s of compiling on one H100 before the first step);
  transformers' `CompileableContextVar` traces only when the whole model is compiled (its `set` runs while compiling),
  and this toolkit compiles the layers alone.
  targets: transformers 5.17 and 5.25 (`utils/output_capturing.py`: `install_output_capuring_hook`'s inner
  `output_capturing_hook(module, args, output)`, `maybe_install_capturing_hooks`, `PreTrainedModel.can_record_outputs`).
  guarded by: test_compiled_output_capture.py::test_compiled_gpt_oss_layers_capture_router_logits_without_a_graph_break
  (no break, at most one graph per layer type, eager's loss, aux loss and LoRA gradients, with and without
  checkpointing, the aux loss's share in them under reentrant checkpoints as under non-reentrant eager ones;
  transformers 5.17 and 5.25) and
  test_compile_once.py::test_compiled_recipes_compile_once_for_rows_of_every_length (the GPT-OSS recipe's one graph).
- `activation_checkpointing_found`
  does: reads how the prepared model's layers are checkpointed: torch's `CheckpointWrapper` around them (imported from
  the private `torch.distributed.algorithms._checkpoint.checkpoint_wrapper`, where accelerate's
  `fsdp_activation_checkpointing` takes it from), else transformers' `gradient_checkpointing` flag on each layer and
  the `_gradient_checkpointing_func` that `compile_inside_checkpoints` sets.
  why: the setup line shows the checkpointing in place, not the one asked for, and the setup check stops a run whose
  accelerate config asked for a checkpointing that wrapped no layer; torch exports the wrapper from no public module.
  targets: torch 2.11 and 2.13, accelerate 1.15-1.16 (`fsdp2_apply_ac`), transformers 5.17-5.25.
  guarded by: tests/test_setup_line.py (accelerate's own `fsdp2_apply_ac` on the tiny Llama, transformers' checkpointing
  switched on by the Trainer, and compile_inside_checkpoints).
- `validate_launch_command`
  does: calls accelerate's `_validate_launch_command`, which completes the launcher's arguments from the config file.
  why: `finetune check` builds the variables a training process would see, with accelerate's own code.
  targets: accelerate 1.15-1.16 (returns args, defaults, mp_from_config_flag).
  guarded by: tests/test_check.py.
- `skip_unused_deepspeed`
  does: puts None in sys.modules["deepspeed"] for a run that does not use DeepSpeed (Python's own "no such module"),
  so accelerate's and transformers' availability checks answer False and nothing imports it.
  why: accelerate imports DeepSpeed whenever it is installed (to unwrap models, in every run), and DeepSpeed imports
  MLflow: 2.1 s of the tiny default run's 16 s before its first step (`python -X importtime`).
  targets: accelerate 1.15-1.16, transformers 5.17-5.24 (`is_deepspeed_available` via importlib.util.find_spec).
  guarded by: tests/test_first_step.py.
- `no_split_modules`, `launcher_flags_given`
  does: reads transformers' `_no_split_modules` (the decoder layer classes, named when an FSDP wrap class matches
  none) and the `nondefault` set accelerate's launch parser fills (which flags the command line gave).
  targets: transformers 5.17-5.25, accelerate 1.15-1.16.
  guarded by: tests/test_external_configs.py (the FSDP wrap refusal, the launch request of each outside file).
- `keep_packed_documents_apart`
  does: a forward pre-hook on the model class a family names (`masks_without_positions`, GPT-OSS's `GptOssModel`)
  that builds its full and sliding-window masks from the position ids with transformers' own mask functions.
  why: GPT-OSS builds its masks without the position ids, so in a packed row each conversation would attend to those
  before it.  targets: transformers 5.17-5.25.
  guarded by: tests/test_attention.py.
- `exit_without_teardown`
  does: runs the atexit handlers, flushes, then `os._exit(0)` at the end of a multi-process run.
  why: gloo's worker threads aborted a finished rank at interpreter teardown in about 1 of 100 CPU launches.
  upstream: pytorch/pytorch#190489.  targets: torch 2.11-2.13.
  guarded by: tests/test_distributed.py (every two-process launch must exit 0).
- `switch_cpu_state_to_fsdp`
  does: sets accelerate's shared state (`PartialState._shared_state`) to FSDP over gloo.
  why: accelerate switches to FSDP only from a GPU state; on CPU it would wrap the model in DDP.
  targets: accelerate 1.15-1.16.
  guarded by: test_distributed.py::test_full_finetune_runs_the_strategy_of_its_config_file[fsdp] and
  ::test_fsdp_config_falling_back_to_ddp_stops_with_a_clear_error.
- `expert_lora.install` (finetune/models/expert_lora.py)
  does: swaps the class of peft's outermost `ParamWrapper` around each GPT-OSS experts module for a subclass whose
  forward runs the experts through grouped GEMMs with the LoRA factors, reading peft's `lora_A`/`lora_B` layout and
  private `_did_swap_in_out_features` as `ParamWrapper.get_delta_weight` does.
  why: peft's forward parametrizes every expert weight as W + B·A and lets autograd compute its full gradient.
  targets: peft 0.21.0-0.21.2 (`ParamWrapper`), transformers 5.17-5.24 (`GptOssExperts`, `is_transposed`).
  guarded by: tests/test_expert_lora.py (against peft's path),
  test_distributed.py::test_lora_saves_the_single_process_adapter.
- `zero3_init_off`
  does: unsets transformers' ZeRO-3 flag (`_hf_deepspeed_config_weak_ref`) while the tiny model is built and written,
  while the meta skeleton the checks read is built, and while the model loads in a ZeRO-3 launch whose
  `zero3_init_flag` is false.
  why: under a ZeRO-3 launch `from_config` builds empty partitions, which would be saved as the tiny model; and
  accelerate sets the flag for every ZeRO-3 launch (`DeepSpeedPlugin.set_deepspeed_weakref`), so that transformers
  loads under deepspeed.zero.Init whatever `zero3_init_flag` says (huggingface/transformers#28106).
  targets: transformers 5.17-5.25, accelerate 1.15-1.16.
  guarded by: test_distributed.py::test_full_finetune_gives_the_single_process_answer[zero3],
  test_deepspeed_flag.py::test_zero3_init_flag_false_loads_the_model_whole and
  test_deepspeed_flag.py::
  test_accelerate_launch_use_deepspeed_flags_reach_the_engine_and_a_save_without_the_gather_is_fixed_as_it_says.
- `nvme_paths_accelerate_does_not_export`
  does: gives the training arguments, while they build accelerate's DeepSpeedPlugin, the launch's
  `offload_optimizer_nvme_path` and `offload_param_nvme_path` (flags or deepspeed_config fields) in the variables the
  plugin reads (`ACCELERATE_DEEPSPEED_OFFLOAD_*_NVME_PATH`).
  why: accelerate's launcher exports every other DeepSpeed field to the training processes but not these two
  (`prepare_deepspeed_cmd_env`), so NVMe offload without a JSON would swap to a folder named `none`.
  targets: accelerate 1.16.
  guarded by: test_deepspeed_flag.py::test_nvme_offload_flags_reach_deepspeed_or_are_refused_before_loading.
- `trainer_output_dir`
  does: reads the folder the Trainer saves checkpoints into through its private `Trainer._get_output_dir(trial)`.
  why: the completeness marker and the rotation go to the folder the Trainer's save wrote (for a hyperparameter-search
  trial a subfolder of `output_dir`), which no public attribute names.
  targets: transformers 5.17 and 5.25 (`_get_output_dir(self, trial)`).
  guarded by: tests/test_preemption_single.py (every resume reads the marker written there).
- `parser_actions`
  does: reads argparse's private `parser._actions`: the options of TRL's parser with their types, nargs and choices.
  why: recipe keys are checked and typed as the command line's flags are (an unknown key named with a hint,
  `lora_r: sixteen` refused), and argparse lists its options nowhere public. finetune/checks/launch.py reads
  accelerate's launcher parser the same way (`_launcher_parser()._actions`).
  targets: Python 3.11 (here) and 3.12 (the GPU image); `_actions` is as old as argparse.
  guarded by: test_bad_inputs.py::test_bad_input_is_one_sentence_naming_file_field_and_fix (the unknown-key and
  not-a-valid-type cases) and test_config.py::test_a_refusal_in_a_real_process_is_one_line_and_exit_code_2 (an unknown
  flag).
- `activation_memory_budget`, `set_activation_memory_budget`
  does: reads and sets torch's private `torch._functorch.config.activation_memory_budget` (the recipe's value);
  `finetune.train` (api.process_state_kept) reads it and puts it back when the run returns.
  why: the share of a compiled layer's activations the partitioner keeps for the backward (the rest is recomputed):
  0.8 saved the 3B LoRA recipe 14 GiB on an H200, and torch has no public setting for it.
  targets: torch 2.11 and 2.13 (`activation_memory_budget = 1.0` in torch/_functorch/config.py).
  guarded by:
  test_config.py::test_the_activation_budget_reaches_inductor_only_for_layers_compiled_without_checkpointing.
- `GroupedExpertsLora` (finetune/models/expert_lora.py)
  does: computes the gate between the two expert projections with transformers' private `GptOssExperts._apply_gate`
  (`install` wraps only experts modules that have it) and leaves modules whose private `_is_expert_parallel` is set
  to peft's path (absent in 5.17, where getattr's False is right).
  why: the gate (a clamped SwiGLU) stays the experts module's own, so the grouped path cannot drift from
  transformers' forward.
  targets: transformers 5.17 and 5.25.
  guarded by: test_expert_lora.py::test_the_tiny_gpt_oss_loss_and_every_gradient_equal_peft.
- `torch._grouped_mm` (finetune/models/expert_lora.py, inside the `finetune::grouped_mm*` custom operators)
  does: runs expert LoRA's grouped GEMMs through torch's private grouped matmul where `grouped_mm_runs` says it takes
  the operands, and a loop over the experts elsewhere (also when torch no longer has it).
  why: one GEMM per expert over rows sorted by expert, in one kernel; the one transformers'
  `experts_implementation="grouped_mm"` calls, and no public op does it.
  targets: torch 2.11 (H200, bf16) and 2.13 (CPU).
  guarded by: test_expert_lora.py::test_the_grouped_experts_trace_whole_under_torch_compile[bfloat16 grouped_mm] and
  ::test_grouped_expert_lora_gives_peft_outputs_and_gradients.
- `mxfp4_experts.make_resident`, `mxfp4_loading.load` (finetune/models/mxfp4_experts.py, finetune/models/mxfp4_loading.py)
  does: swaps the class of each GPT-OSS experts module for a subclass whose forward is expert_lora's grouped path,
  replaces its `gate_up_proj`/`down_proj` with one-element zero-stride placeholders beside uint8 blocks and scales
  buffers, and fills a model built on the meta device (accelerate's `init_empty_weights`) from the safetensors shards,
  writing rotary buffers back through the module's private `_buffers`.
  why: transformers keeps MXFP4 experts packed only through the hub's `kernels` (and else silently dequantizes);
  peft's `target_parameters` needs parameters of the dense shape to build its adapters.
  targets: transformers 5.17 and 5.25 (`GptOssExperts`, `from_config`), peft 0.21 (`ParamWrapper` reads only the
  shape, dtype and device of the placeholder).
  guarded by: tests/test_mxfp4_resident.py.
- `merging.merge` (finetune/run/merging.py, the streamed merge of an MXFP4 base)
  does: picks the modules to merge as peft's private `BaseTuner._unload_and_optionally_merge` does (the outermost with
  `unload_and_optionally_merge_module` or a `base_layer`) and merges each with its public merge methods; merges an
  expert stack's `ParamWrapper` a chunk of experts at a time with the einsum, scaling and rounding of
  `ParamWrapper.get_delta_weight`, reading its `lora_A`/`lora_B` layout and private `_did_swap_in_out_features`;
  makes a meta module's tensors real through `nn.Module._parameters`/`_buffers`.
  why: peft merges only a whole loaded model, and its expert merge forms the stack's delta in float32 twice
  (17 GiB for one GPT-OSS-120B gate_up_proj).
  targets: peft 0.21.2, transformers 5.25 (`GptOssExperts`).
  guarded by: test_mxfp4_merge.py::test_streamed_merge_of_an_mxfp4_base_is_the_in_memory_merge_bit_for_bit (4 experts
  in chunks of 3 and 1, against merge_and_unload).
- `model._require_grads_hook` (finetune/models/compilation.py, `one_graph_for_every_layer`)
  does: reads transformers' private handle of the hook `enable_input_require_grads` registers, to register it once.
  why: transformers has no public way to ask whether input gradients are already enabled.
  targets: transformers 5.17 and 5.25.
  guarded by: nothing fails on a rename (a second, identical hook would be registered);
  test_compile_once.py::test_compiled_recipes_compile_once_for_rows_of_every_length checks what the hook is for.
- `model.config._attn_implementation` (finetune/run/evaluation.py, `_batch_size`; finetune/run/generation.py,
  `attention_for_generation`)
  does: reads which attention the loaded model runs: a model trained with `torch_varlen` generates one row at a time,
  one trained with `flex_attention` generates with eager attention.
  why: transformers keeps the choice in this private property only.
  targets: transformers 5.17 and 5.25 (a property of `PreTrainedConfig`).
  guarded by: no test yet; on a rename getattr's None would batch 16 left-padded rows through `torch_varlen`.
- `torch._dynamo.utils.counters` (finetune/run/speed.py, `compiled_graphs`)
  does: reads dynamo's private count of the graphs it built (`counters["stats"]["unique_graphs"]`).
  why: recompilations are what finetune_speed.json shows first; torch has no public count.
  targets: torch 2.11 and 2.13.
  guarded by: test_compile_once.py::test_compiled_recipes_compile_once_for_rows_of_every_length.
- `cache_graphs_with_custom_autograd_functions`
  does: sets `torch._functorch.config.autograd_cache_allow_custom_autograd_functions`.
  why: AOTAutograd's cache skips every graph that holds a `torch.autograd.Function` (GPT-OSS's layers hold
  finetune/models/expert_lora.py's `GroupedLoraMatmul`), so each launch traced and partitioned them again. It is safe
  for ours: dynamo traces the Function's forward and backward into the graph the cache is keyed on (the scaling, the
  only non-tensor it keeps, as a constant), and they call only torch's ops and this toolkit's `torch.library` custom
  ops, which the compiled code calls at run time rather than copying.
  targets: torch 2.11 and 2.13 (the config, and TORCHINDUCTOR_AUTOGRAD_CACHE_ALLOW_CUSTOM_AUTOGRAD, its variable).
  guarded by: test_compile_once.py::test_a_second_launch_loads_every_compiled_graph_from_the_cache.
- `compile_workers_started_early`
  does: calls `torch._inductor.async_compile.maybe_warm_pool()` when a compiled run on a GPU parses its arguments,
  before the model loads: inductor's Triton compile workers start then (torch skips it where Triton is missing).
  why: torch.compile(backend="inductor") starts them only at the first kernel, and until they answer inductor compiles
  each Triton kernel in the training process, one at a time (`use_process_pool()` in `AsyncCompile.triton`); on the
  H100 the process's first compile, GPT-OSS-20B's first flex block mask, took 28.9 s against 2.9 s for the second
  (docs/results/first-step-2026-12-06c-h100). Started early, they start while the model loads. torch's own
  `inductor` backend function calls the same, "as early as possible". Not yet measured on a GPU.
  targets: torch 2.11 and 2.13 (`maybe_warm_pool`: `AsyncCompile.warm_pool()` then `wakeup()`).
  guarded by: test_first_step.py::test_on_a_gpu_a_compiled_run_skips_the_cpu_probe_and_starts_compile_workers_early
  (called on a GPU only).
- `block_masks_compiled_for_every_length`
  does: replaces `transformers.masking_utils.create_block_mask` (the name transformers calls) by a function that,
  where transformers asks for `_compile=True`, calls one `torch.compile(create_block_mask, dynamic=True)` with the
  arguments as given, instead of torch's `torch.compile(create_block_mask)`; without `_compile`, torch's function.
  why: flex attention's block masks (GPT-OSS: sliding and full) were compiled with static shapes for the first row
  length, then each once more when the length changed, automatic dynamic shapes' second pass: 4 compiles instead of 2
  in GPT-OSS-20B's first step on one H100, 10.2 s of compiling and 4.1 s of dynamo tracing cold, the tracing again at
  every launch (docs/results/first-step-2026-12-06c-h100, gptoss20b_lora_ckpt.log, frames 0/2 and 0/3).
  targets: transformers 5.17 and 5.25 (`masking_utils.flex_attention_mask` calls the module's `create_block_mask`
  with `_compile=True`); torch 2.11 and 2.13 (`create_block_mask(..., _compile)`).
  guarded by: test_compiled_output_capture.py::test_flex_block_masks_compile_once_per_mask_type_for_every_length.
- `constant_float_inputs`
  does: sets `torch._dynamo.config.specialize_float = True` in a compiled run.
  why: the layers are compiled with dynamic shapes and their modules unspecialized, so dynamo first traces every
  Python float it meets (the attention's scaling, the norms' epsilon, LoRA's scaling, dropout probabilities) as a
  symbol, then its pass that turns symbolic floats into tensors fails on them and restarts the whole trace with them
  specialized: "Restarting analysis due to fx/passes/_tensorify_python_scalars.py" in dynamo's log, 4.2 s of the
  3B LoRA recipe's cold first step and 4.6 s of its warm one on the H100 (docs/results/first-step-2026-12-06b-h100).
  These floats are the same in every layer and every step, so tracing them as constants from the start gives the
  same graph without the second trace.
  targets: torch 2.11 and 2.13 (the config key).
  guarded by: test_first_step.py::test_a_compiled_layer_traces_its_floats_as_constants_without_restarting.
- `no_cpu_vector_probe`
  does: sets `torch._inductor.config.cpp.vec_isa_ok = False` in a compiled run on a GPU.
  why: to build the C++ kernels a GPU graph still holds (small host-side computations), inductor first asks which CPU
  vector instructions work by compiling a probe per instruction set and, on torch 2.11, loading each in a new Python
  that imports torch: 33 s of a warm launch's first step on the H100 (cProfile of the 3B LoRA recipe relaunched on a
  warm cache, docs/results/first-step-2026-12-06-h100), in every process, cached nowhere. Set, inductor builds those
  few kernels without vector instructions and asks nothing; a CPU run, whose kernels are the whole model, keeps them.
  targets: torch 2.11 and 2.13 (`VecISA.__bool__` returns `config.cpp.vec_isa_ok` when it is not None).
  guarded by: test_first_step.py::test_on_a_gpu_a_compiled_run_skips_the_cpu_probe_and_starts_compile_workers_early.
- `CompileCacheEvents` (finetune/run/speed.py, `compile_caches`)
  does: reads `torch._dynamo.utils.counters` ("inductor": fxgraph_cache_*, "aot_autograd": autograd_cache_*) and
  listens to the loggers `torch._inductor.codecache` and `torch._functorch._aot_autograd.autograd_cache` for the
  reasons they give for not caching a graph ("Bypassing ...", "unable to serialize ..."), at their INFO level, without
  letting those records reach torch's own handlers unless TORCH_LOGS asked for them.
  why: a launch that finds the caches warm but compiles again says why only there; torch has no public record of it.
  targets: torch 2.11 and 2.13.
  guarded by: test_compile_once.py::test_a_second_launch_loads_every_compiled_graph_from_the_cache.
- `torch._dynamo.utils.compilation_time_metrics` (finetune/run/speed.py, `compile_seconds`)
  does: reads dynamo's private table of seconds per timed compile phase (what `torch._dynamo.utils.compile_times`
  prints).
  why: the first step's wait is mostly compiling; which phase takes it decides what to shorten.
  targets: torch 2.11 and 2.13 (a dict of phase name to a list of seconds).
  guarded by: test_compile_once.py::test_compiled_recipes_compile_once_for_rows_of_every_length.
- `resume.apply_learning_rate` (finetune/checks/resume.py, `--resume_with_new_schedule`)
  does: rewrites the Trainer's LambdaLR `base_lrs` and each optimizer group's `initial_lr` and `lr`, reading
  `lr_lambdas` and `last_epoch`: no underscore, but the scheduler's state, not an interface for changing it.
  why: the resumed checkpoint restores the old schedule; scaling its base rates keeps its shape at the new rate.
  targets: torch 2.11 and 2.13 (`LambdaLR.get_lr` = base_lr * lr_lambda(last_epoch)).
  guarded by:
  test_preemption_single.py::test_a_resume_applies_a_new_learning_rate_when_asked_and_the_new_logging_cadence.
- `never_ask_to_run_remote_code` (called by finetune/checks/model_folder.py `check_model`, which every path runs
  before it loads a model, tokenizer or config)
  does: sets `transformers.dynamic_module_utils.TIME_OUT_REMOTE_CODE` to 0, so that a config, tokenizer or model whose
  folder names its own code (`auto_map`) loaded without `trust_remote_code` is refused (transformers' ValueError)
  instead of asked about.
  why: with `trust_remote_code` left unset transformers asks "Do you wish to run the custom code? [y/N]" on stdin for
  15 s: `echo y | finetune chat FOLDER` (or a first chat line "y") imported and ran the folder's Python file. Code
  from a model folder runs only where the user set `trust_remote_code: true`, which passes it explicitly.
  targets: transformers 5.17-5.25 (`resolve_trust_remote_code` prompts only while TIME_OUT_REMOTE_CODE > 0).
  guarded by: test_bad_model_folders.py::test_a_model_folder_that_needs_its_own_code_is_refused_and_its_code_never_runs.
- `weights_only_loads` (used by finetune/checks/resume.py `read_safely` around every resume, the relaunch check's
  read of training_args.bin, and finetune/run/model.py `load_adapter`)
  does: for its duration replaces `torch.load` with a call that passes `weights_only=True` whatever its caller asked
  (DeepSpeed's checkpoint engine and torch DCP's `DefaultLoadPlanner.load_bytes` ask for False), and has torch DCP's
  `FileSystemReader.read_metadata` (which unpickles `.metadata` with plain `pickle.load`, through the module's
  `pickle` name) unpickle with Python's unpickler restricted to the globals torch's weights-only unpickler allows
  (its private `_get_allowed_globals`: tensors, torch.Size, dtypes, containers) and the caller's fixed list of
  classes, which torch.load gets through `torch.serialization.safe_globals`. Under each listed class's name both
  unpicklers find a stand-in (`_built_without_init`; enums, numpy and pathlib types are left as they are) that makes
  an instance with `cls.__new__(cls)` as a pickle of an instance does, so that a file calling the class with
  arguments of its own (REDUCE) never runs its `__init__`; the class itself is listed under a name no file uses, for
  torch's check of the instances it builds. A file either refuses goes to the
  caller's `refusal(file, error)` (one sentence), raised where the block ends: on its way there it passes through
  the libraries as a BaseException, which DCP's `except Exception` (logging a traceback, trying a rank's own
  metadata) lets through and its gather of every rank's failure carries.
  why: DeepSpeed (`global_stepN/*_model_states.pt`, `*_optim_states.pt`) and DCP (`.metadata`, non-tensor entries)
  unpickle whatever a checkpoint holds: a pickle planted in a checkpoint copied from elsewhere would run its code on
  resume. Neither library has a setting for it (torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD leaves DCP's pickle.load out
  and gives no file name).
  targets: torch 2.11 and 2.13 (`torch.load`, `FileSystemReader.read_metadata`, `_get_allowed_globals`),
  deepspeed 0.18-0.19 (`TorchCheckpointEngine.load` calls `torch.load`), transformers 5.17-5.25, peft 0.21.
  guarded by: test_safety.py::test_a_payload_in_any_checkpoint_file_is_refused_in_one_line_and_never_runs,
  test_checkpoint_payloads.py (every kind of file; test_a_file_calling_an_allowed_class_never_runs_its_init),
  test_distributed.py (every strategy resumes its real checkpoints under it).
- `deepspeed_collectives_without_compiled_op`
  does: marks DeepSpeed's shared-memory collectives op (`deepspeed_shm_comm`) as not buildable in
  `deepspeed.ops.__compatible_ops__`, so that DeepSpeed's communication backend does its all-reduces through
  torch.distributed (gloo), its own path where the op cannot be built; CPU runs only. Where the table was not built yet
  it is set to that one entry: building it probes every op with a compiler (libaio's probe prints a linker error).
  why: DeepSpeed compiles that op with g++ on its first CPU run (about 2 min on 2 cores, needing ninja and a compiler)
  to speed up all-reduces that a CPU run of a tiny model spends no time in.
  targets: deepspeed 0.19.8 (`build_shm_op` in deepspeed/comm/torch.py reads the table).
  guarded by: test_distributed.py::test_full_finetune_runs_the_strategy_of_its_config_file[zero2] (no op built).
- `hidden_while_importing`, `skip_unused_libraries`, `bring_back`
  does: puts None in sys.modules for bitsandbytes, scikit-learn and scipy while finetune/sft.py imports the run's
  modules (Python's own "no such module": `importlib.util.find_spec` answers None, an import raises ImportError), then
  for the run keeps scikit-learn and scipy out, and bitsandbytes too unless it quantizes (`load_in_4bit`/`8bit`) or
  trains with one of transformers' bitsandbytes optimizers (`trainer_optimizer._BITSANDBYTES_OPTIMIZERS`, private)
  or an 8-bit one; a run that uses it gets it back, with peft's `is_bnb_available`/`is_bnb_4bit_available` and
  transformers' `is_bitsandbytes_available` (cached) asked again. `finetune.train` brings them all back afterwards.
  why: peft/helpers.py imports bitsandbytes at import whenever it is installed (for a kappa-analysis helper this
  toolkit never calls; it keeps None there), and peft's LoRA again when it wraps a model; transformers 5.17's
  generation/candidate_generator.py imports scikit-learn (and with it scipy), its detection losses scipy.optimize,
  datasets scipy.io when it loads rows: on one H100 (torch 2.11, transformers 5.17) 1.2 s of
  bitsandbytes (which imports inductor's compile_fx) and 1.16 s of scikit-learn out of 7.6 s of `import finetune.sft`.
  None of it has a switch. TRL's activation offloading empties the CUDA cache at each step while "bitsandbytes" is a
  key of sys.modules, which it stays (None), as when peft had imported it.
  targets: peft 0.21 (helpers.py, tuners/lora/model.py's dispatchers), transformers 5.17-5.25 (`_is_package_available`
  via find_spec, `trainer_optimizer._BITSANDBYTES_OPTIMIZERS`), datasets 5.2 (`extend_module_for_streaming`).
  guarded by: test_first_step.py::test_a_lora_run_imports_neither_bitsandbytes_nor_scikit_learn_nor_scipy and
  test_first_step.py::test_bitsandbytes_stays_out_of_a_run_that_does_not_quantize_and_comes_back_for_one_that_does;
  QLoRA: test_distributed.py::test_qlora_trains_with_ddp.
"""

import argparse
import atexit
import contextlib
import os
import pickle
import sys
from functools import cache, partial
from pathlib import Path

from finetune.families import FAMILIES


@contextlib.contextmanager
def rotation_deferred():
    """The Trainer rotates checkpoints inside its save, before our marker exists; skip that, `checkpoints.rotate`
    runs once the marker is written."""
    import transformers.trainer as trainer_module

    original = trainer_module.rotate_checkpoints
    trainer_module.rotate_checkpoints = lambda *args, **kwargs: None
    try:
        yield
    finally:
        trainer_module.rotate_checkpoints = original


def _checkpoint_compiled(checkpoint, compiled_call, function, *args):
    # Reentrant: the backward reruns the layer and differentiates that rerun. Non-reentrant checkpointing instead
    # requires the rerun to save tensors shaped like the forward's, which two compiled graphs need not do (GPT-OSS
    # with expert LoRA on an H200: CheckpointError "Recomputed values ... have different metadata").
    return checkpoint(compiled_call, function, *args, use_reentrant=True)


def _with_gradients_detached(compiled_call, function, *args):
    """A reentrant checkpoint runs its layer twice: without gradients, then again in backward with them. Compiled,
    that was two graphs per layer type, the first without a backward (GPT-OSS-20B on an H100: 15 of its 96 s of
    compiling, and dynamo traced both at every launch). Run with gradients both times, the recomputation reuses the
    first pass's graph; the first pass's outputs are detached, so what its graph saved is freed as it returns, as
    the recomputation's is after its backward."""
    import torch

    if torch.is_grad_enabled():
        return compiled_call(function, *args)
    with torch.enable_grad():
        output = compiled_call(function, *args)
    return _detached(output)


def _detached(value):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def _same_tensor(tensor):
    return tensor


def _kept_without_history(tensor):
    # A tensor with a history would hold its autograd node where the node saved its own output (tanh, softmax, a
    # compiled layer's outputs): a cycle that nothing frees, so every checkpoint's first pass would stay alive
    # (GPT-OSS-20B on one H100: 76.9 GiB instead of 21). Autograd gives the unpacked tensor its history back. One
    # without (a weight, the MXFP4 experts' bytes) comes back as the very tensor: their dequantized weights are kept
    # by the identity of what they came from (mxfp4_experts.DequantizePrefetch).
    return tensor.detach() if tensor.grad_fn is not None else tensor


def _call_keeping_saved_tensors(compiled_call, function, *args):
    """The innermost saved-tensor hooks win: these keep what the call saves where it is, out of the offloading hooks:
    the checkpoint's first pass frees what it saved as it returns (_with_gradients_detached), the recomputation
    after its layer's backward."""
    import torch

    with torch.autograd.graph.saved_tensors_hooks(_kept_without_history, _same_tensor):
        return compiled_call(function, *args)


def decoder_layers(model) -> list:
    """The model's decoder layers: transformers' `GradientCheckpointingLayer`s."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def compile_inside_checkpoints(model, compiled_call, offloading: bool = False) -> None:
    """Every checkpointed layer runs checkpoint(compiled(layer)) instead of compiled(checkpoint(layer)); one compiled
    function serves all layers, so the layer compiles once. With activation offloading only the checkpoint's inputs
    go to the CPU: the layer recomputed in backward keeps its tensors on the device until its gradients are done.
    Outputs the layer's modules capture go to transformers after the compiled call (defer_output_capture)."""
    call = partial(_with_gradients_detached, partial(_call_keeping_saved_tensors, compiled_call) if offloading
                   else compiled_call)
    capturing = defer_output_capture(model)
    for index, module in enumerate(decoder_layers(model)):
        checkpoint = getattr(module, "_gradient_checkpointing_func", None)
        if not _compiled_inside_checkpoint(module):
            layer_call = partial(compiled_then_handed_over, call, capturing[index]) if capturing else call
            module._gradient_checkpointing_func = partial(_checkpoint_compiled, checkpoint, layer_call)


_DEFERRED_HOOKS = "_finetune_output_capture"  # transformers' hooks taken out of the compiled region, on their module
_STASHED = "_finetune_captured"  # (inputs, output) a compiled forward left for them


def defer_output_capture(model) -> list:
    """Where the model captures outputs of its layers' modules (its config asks for any of `can_record_outputs`),
    transformers' capturing hooks inside the decoder layers run eagerly after each compiled layer instead of inside
    it. Returns, per decoder layer, its modules that capture (children before parents); empty where nothing captures."""
    from transformers.modeling_utils import PreTrainedModel
    from transformers.utils import output_capturing

    layers = decoder_layers(model)
    recording = [module for module in model.modules() if isinstance(module, PreTrainedModel)
                 and any(getattr(module.config, f"output_{key}", False) for key in module.can_record_outputs)
                 and layers and any(layer is layers[0] for layer in module.modules())]
    if not recording:
        return []
    output_capturing.maybe_install_capturing_hooks(recording[-1])
    per_layer = []
    for layer in layers:
        capturing = [module for module in _children_first(layer) if _take_capturing_hooks(module, output_capturing)]
        per_layer.append(capturing)
    return per_layer if any(per_layer) else []


def _children_first(module):
    for child in module.children():
        yield from _children_first(child)
    yield module


def _take_capturing_hooks(module, output_capturing) -> bool:
    """Moves transformers' capturing hooks of `module` into its deferred list, with the shared hook in their place;
    whether the module captures anything."""
    taken = [(key, hook) for key, hook in module._forward_hooks.items()
             if getattr(hook, "__module__", None) == output_capturing.__name__
             and getattr(hook, "__name__", None) == "output_capturing_hook"]
    for key, _ in taken:
        del module._forward_hooks[key]
        module._forward_hooks_with_kwargs.pop(key, None)
        module._forward_hooks_always_called.pop(key, None)
    if taken and _DEFERRED_HOOKS not in module.__dict__:
        module.__dict__[_DEFERRED_HOOKS] = []
        module.register_forward_hook(_stash_or_capture)
    module.__dict__.get(_DEFERRED_HOOKS, []).extend(hook for _, hook in taken)
    return _DEFERRED_HOOKS in module.__dict__


def _stash_or_capture(module, args, output):
    """One hook for every capturing module, so that all layers look the same to the compiler: compiled, an attribute
    write (dynamo replays it after the graph); eager, transformers' own hooks."""
    import torch

    if torch.compiler.is_compiling():
        setattr(module, _STASHED, (args, output))
    else:
        _run_deferred_hooks(module, args, output)


def _run_deferred_hooks(module, args, output) -> None:
    for hook in module.__dict__[_DEFERRED_HOOKS]:
        hook(module, args, output)


def compiled_then_handed_over(compiled_call, capturing: list, function, *args):
    """`compiled_call(function, *args)`, then, eagerly, what the compiled layer's modules stashed goes to
    transformers' hooks (to the collector when one is active, else nowhere), and the stashes are dropped.

    Inside a reentrant checkpoint the captured outputs still train, as they do eagerly under transformers' default
    (non-reentrant) checkpointing: the first pass, which runs without gradients, hands transformers leaves that
    require a gradient (the router logits TRL's load-balancing loss reads) and keeps them on their module; the loss's
    backward fills their gradients before it reaches the layer's checkpoint (autograd runs the nodes created last
    first, and the loss was built after every layer); the recomputation then sends those gradients into its own
    captured outputs along with the layer's output gradient (_with_first_pass_gradients)."""
    import torch

    output = compiled_call(function, *args)
    for module in capturing:
        stashed = module.__dict__.pop(_STASHED, None)
        if stashed is None:
            continue
        inputs, captured = stashed
        if torch.is_grad_enabled():
            output = _with_first_pass_gradients(output, module.__dict__.pop(_FIRST_PASS, None), captured)
        elif _requires_grad(captured):  # a checkpoint's first pass, compiled with gradients (_with_gradients_detached)
            inputs, captured = _detached(inputs), _leaves(captured)
            module.__dict__[_FIRST_PASS] = captured
        _run_deferred_hooks(module, inputs, captured)
    return output


_FIRST_PASS = "_finetune_first_pass_captured"  # the leaves a checkpoint's first pass handed to transformers


def _requires_grad(value) -> bool:
    import torch
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(value))


def _leaves(value):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda tensor: tensor.detach().requires_grad_(tensor.requires_grad), value)


def _with_first_pass_gradients(output, first_pass, recomputed):
    """The recomputed layer output, through an identity whose backward also sends into each output the recomputation
    captured the gradient its first-pass leaf received from the loss."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

    pairs = [(again, leaf.grad) for leaf, again in zip(tree_leaves(first_pass), tree_leaves(recomputed))
             if isinstance(leaf, torch.Tensor) and leaf.grad is not None and again.requires_grad]
    if not pairs:
        return output
    flat, spec = tree_flatten(output)
    first = next(index for index, tensor in enumerate(flat) if isinstance(tensor, torch.Tensor) and tensor.requires_grad)
    flat[first] = _gradient_injection().apply(flat[first], [gradient for _, gradient in pairs],
                                              *(again for again, _ in pairs))
    return tree_unflatten(flat, spec)


@cache
def _gradient_injection():
    import torch

    class GradientInjection(torch.autograd.Function):
        @staticmethod
        def forward(ctx, output, gradients, *captured):
            ctx.gradients = gradients
            return output.view_as(output)

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None, *ctx.gradients

    return GradientInjection


def _compiled_inside_checkpoint(layer) -> bool:
    return getattr(getattr(layer, "_gradient_checkpointing_func", None), "func", None) is _checkpoint_compiled


def activation_checkpointing_found(model) -> str:
    """How the model's layers are checkpointed, as found on its modules: "fsdp" (torch's CheckpointWrapper around
    them: accelerate's `fsdp_activation_checkpointing`), "transformers" (each layer checkpoints itself: the recipe's
    `gradient_checkpointing`), "transformers, compiled inside" (and runs its compiled self inside the checkpoint:
    compile_inside_checkpoints), or "none"."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    modules = list(model.modules())
    if any(isinstance(module, CheckpointWrapper) for module in modules):
        return "fsdp"
    layers = [module for module in modules if getattr(module, "gradient_checkpointing", False) is True]
    if not layers:
        return "none"
    return "transformers, compiled inside" if any(map(_compiled_inside_checkpoint, layers)) else "transformers"


def exit_without_teardown() -> None:
    """What a normal exit runs first (logging, trackers: wandb finishes its run here), then exit 0 without the
    interpreter's finalization, during which gloo's worker threads can abort a finished rank."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def switch_cpu_state_to_fsdp() -> None:
    """accelerate's state as FSDP over gloo, with the plugin built from the launch's FSDP_* variables; the Trainer's
    Accelerator reuses it."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

    plugin = FullyShardedDataParallelPlugin()
    state = AcceleratorState(cpu=True, dynamo_plugin=TorchDynamoPlugin(), fsdp_plugin=plugin, _from_accelerator=True)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@contextlib.contextmanager
def zero3_init_off():
    """`from_config` and `from_pretrained` inside a ZeRO-3 launch build the model under deepspeed.zero.Init
    (placeholders for the rank's partition); with transformers' ZeRO-3 flag unset they build whole parameters."""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


# The variables accelerate's DeepSpeedPlugin reads each NVMe folder from, by the launcher's field
NVME_PATH_VARIABLES = {"offload_optimizer_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
                       "offload_param_nvme_path": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"}


def nvme_paths_accelerate_does_not_export(request) -> dict[str, str]:
    """The NVMe folders the launch (a LaunchRequest, or None) names, as the variables accelerate's launcher would
    have exported; one already in the environment is kept."""
    if request is None:
        return {}
    return {variable: str(request.value(field)) for field, variable in NVME_PATH_VARIABLES.items()
            if request.value(field) is not None and variable not in os.environ}


def trainer_output_dir(trainer, trial) -> Path:
    """The folder the Trainer's own save writes checkpoints into: `output_dir`, or a search trial's subfolder."""
    return Path(trainer._get_output_dir(trial=trial))


def validate_launch_command(args):
    """accelerate's launcher arguments completed from the config file as `accelerate launch` completes them, and the
    config file's values: (args, defaults)."""
    from accelerate.commands.launch import _validate_launch_command

    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every option of the parser, with its dest, type, nargs and choices."""
    return parser._actions


def activation_memory_budget() -> float:
    """The partitioner's current budget (see set_activation_memory_budget), for a caller that puts it back."""
    from torch._functorch import config as functorch_config

    return functorch_config.activation_memory_budget


def set_activation_memory_budget(budget: float) -> None:
    """The share of a compiled region's activations that the partitioner keeps for the backward (1.0: all of them;
    below, it recomputes the cheapest instead)."""
    from torch._functorch import config as functorch_config

    functorch_config.activation_memory_budget = budget


def never_ask_to_run_remote_code() -> None:
    from transformers import dynamic_module_utils

    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0


def no_cpu_vector_probe() -> None:
    from torch._inductor import config as inductor_config

    inductor_config.cpp.vec_isa_ok = False


def compile_workers_started_early() -> None:
    from torch._inductor.async_compile import maybe_warm_pool

    maybe_warm_pool()


def block_masks_compiled_for_every_length() -> None:
    from transformers import masking_utils

    if getattr(masking_utils.create_block_mask, "compiled_for_every_length", False):
        return
    import torch

    create_block_mask = masking_utils.create_block_mask
    compiled = torch.compile(create_block_mask, dynamic=True)

    def create_block_mask_compiled_for_every_length(*args, _compile: bool = False, **kwargs):
        return (compiled if _compile else create_block_mask)(*args, **kwargs)

    create_block_mask_compiled_for_every_length.compiled_for_every_length = True
    masking_utils.create_block_mask = create_block_mask_compiled_for_every_length


def constant_float_inputs() -> None:
    from torch._dynamo import config as dynamo_config

    dynamo_config.specialize_float = True


def cache_graphs_with_custom_autograd_functions() -> None:
    from torch._functorch import config as functorch_config

    functorch_config.autograd_cache_allow_custom_autograd_functions = True


def skip_unused_deepspeed(training) -> None:
    """A run that does not use DeepSpeed sees it as not installed: None in sys.modules is Python's own "no such
    module", so accelerate's and transformers' checks (importlib.util.find_spec) answer False and nothing imports it.
    A later run in this process that uses DeepSpeed (the Python API) gets it back."""
    uses_deepspeed = bool(training.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    if uses_deepspeed:
        bring_back(["deepspeed"])
    else:
        sys.modules.setdefault("deepspeed", None)


def no_split_modules(model) -> list[str]:
    """The decoder layer classes transformers keeps whole (`PreTrainedModel._no_split_modules`)."""
    return list(getattr(model, "_no_split_modules", None) or [])


def launcher_flags_given(args) -> set[str]:
    """The flags of `accelerate launch` given on its command line, as accelerate's parser records them
    (`nondefault`, set by its `_StoreAction`s)."""
    return set(getattr(args, "nondefault", set()))


def keep_packed_documents_apart(model) -> None:
    """GPT-OSS builds its masks without the position ids (transformers 5.17 to 5.25), so in a packed row every
    conversation would attend to the ones before it. A pre-hook builds its full and sliding-window masks from the
    position ids instead (transformers' own mask functions: each conversation attends only to itself, the window
    counted within it; the sinks are the attention's), once per batch and outside the compiled layers."""
    classes = {family.masks_without_positions for family in FAMILIES.values() if family.masks_without_positions}
    for module in model.modules():
        if type(module).__name__ in classes:
            module.register_forward_pre_hook(_masks_from_positions, with_kwargs=True)


def _masks_from_positions(module, args, kwargs):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    position_ids, input_ids = kwargs.get("position_ids"), kwargs.get("input_ids")
    caching = kwargs.get("use_cache") or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
    if args or position_ids is None or input_ids is None or kwargs.get("attention_mask") is not None or caching:
        return None
    embeddings = module.embed_tokens(input_ids)
    masks = {
        "full_attention": create_causal_mask(module.config, embeddings, None, None, position_ids=position_ids),
        "sliding_attention": create_sliding_window_causal_mask(module.config, embeddings, None, None,
                                                                position_ids=position_ids),
    }
    return args, {**kwargs, "input_ids": None, "inputs_embeds": embeddings, "attention_mask": masks}


UNREADABLE = (EOFError, RuntimeError, ValueError)  # with pickle.UnpicklingError: a file cut short, damaged or refused


class _AllowedGlobalsOnly(pickle.Unpickler):
    """Python's unpickler restricted to the globals torch's weights-only unpickler allows and the caller's list: DCP's
    `.metadata` is a plain pickle of protocol 4, which torch's own unpickler does not read."""

    def __init__(self, file, allowed_globals: dict):
        super().__init__(file)
        self.allowed_globals = allowed_globals

    def find_class(self, module, name):
        found = self.allowed_globals.get(f"{module}.{name}")
        if found is None:  # worded as torch words it: unreadable_reason names the global
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")
        return found


def _built_without_init(cls):
    """What the unpicklers find under `cls`'s name: the class itself where calling it is harmless (an enum, a numpy or
    pathlib type), else a stand-in that makes an instance of `cls` without running its `__init__`. A pickle of an
    instance rebuilds it as `cls.__new__(cls)` and its state (NEWOBJ, BUILD), which the stand-in does the same; a
    pickle that calls the class with arguments of its own (REDUCE) would otherwise run its `__init__` with them
    (TrainingArguments' `__post_init__` reads DeepSpeed files and sets the environment; PartialState sets up
    processes), and gets an instance made without it."""
    import enum

    if not isinstance(cls, type) or issubclass(cls, enum.Enum) or cls.__module__.split(".")[0] in ("numpy", "pathlib"):
        return cls

    class BuiltWithoutInit:
        def __new__(stand_in, *args, **kwargs):
            return cls.__new__(cls)

    BuiltWithoutInit.__qualname__ = BuiltWithoutInit.__name__ = f"{cls.__name__}BuiltWithoutInit"
    return BuiltWithoutInit


class _Refused(BaseException):
    """A file refused, on its way out through the libraries reading it: DCP logs an Exception with its traceback and
    tries another file, and gathers every rank's failure into one CheckpointException; weights_only_loads raises the
    refusal itself where its loads end."""


@contextlib.contextmanager
def weights_only_loads(allowed: list, refusal):
    """Every torch.load, and torch DCP's read of a `.metadata` file, through torch's weights-only unpickler with only
    `allowed` classes beyond torch's own; a file that either refuses or cannot read ends the block with the exception
    `refusal(file, error)` returns (file None for bytes read from inside a checkpoint)."""
    import types

    import torch
    from torch import _weights_only_unpickler
    from torch.distributed.checkpoint import filesystem

    load, read_metadata = torch.load, filesystem.FileSystemReader.read_metadata
    refused = []

    def refuse(file: Path | None, error: Exception):
        refused.append(refusal(file, error))
        raise _Refused() from None

    def load_weights_only(f, *args, weights_only=None, pickle_module=None, **kwargs):
        try:
            return load(f, *args, weights_only=True, **kwargs)
        except (pickle.UnpicklingError, *UNREADABLE) as error:
            refuse(Path(f) if isinstance(f, (str, os.PathLike)) else None, error)

    def read_metadata_weights_only(reader, *args, **kwargs):
        try:
            return read_metadata(reader, *args, **kwargs)
        except (pickle.UnpicklingError, *UNREADABLE) as error:
            refuse(Path(reader.path) / ".metadata", error)

    by_name = {f"{cls.__module__}.{cls.__qualname__}": _built_without_init(cls) for cls in allowed}
    allowed_globals = {**_weights_only_unpickler._get_allowed_globals(), **by_name}
    weights_only_pickle = types.SimpleNamespace(**vars(pickle))
    weights_only_pickle.load = lambda file, **_: _AllowedGlobalsOnly(file, allowed_globals).load()
    torch.load, filesystem.FileSystemReader.read_metadata = load_weights_only, read_metadata_weights_only
    filesystem.pickle = weights_only_pickle
    # torch's unpickler finds a class by name (the stand-in) and builds an instance only of a type among the values
    # (the class itself, under a name no file uses)
    listed = [*((found, name) for name, found in by_name.items()),
              *((cls, f"finetune.patches.built.{name}") for name, cls in zip(by_name, allowed)
                if by_name[name] is not cls)]
    try:
        with torch.serialization.safe_globals(listed):
            yield
    except BaseException:
        if refused:
            raise refused[0] from None
        raise
    finally:
        torch.load, filesystem.FileSystemReader.read_metadata, filesystem.pickle = load, read_metadata, pickle
def deepspeed_collectives_without_compiled_op() -> None:
    """DeepSpeed's collectives through torch.distributed (gloo) instead of its shared-memory op, which it would
    otherwise compile on the first CPU run. Nothing to do in a run without DeepSpeed (`skip_unused_deepspeed`)."""
    if sys.modules.get("deepspeed", False) is None:
        return
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    found = vars(deepspeed.ops).get("__compatible_ops__")
    if found is not None:
        found[ShareMemCommBuilder.NAME] = False
    else:  # not probed yet: probing every op runs a compiler per op (libaio's prints a linker error on stderr);
        # only deepspeed/comm/torch.py reads the table, for this op alone
        deepspeed.ops.__compatible_ops__ = {ShareMemCommBuilder.NAME: False}


# Libraries that transformers, peft and datasets import whenever they are installed, though no run of this toolkit
# uses scikit-learn or scipy, and only some bitsandbytes: peft/helpers.py (bitsandbytes) and transformers 5.17's
# generation/candidate_generator.py (scikit-learn, which imports scipy) when the training process imports them,
# transformers' detection losses (scipy.optimize) too, peft's LoRA (bitsandbytes, to look for its quantized layers)
# when it wraps the model, datasets (scipy.io, to patch it for streaming) when it loads the rows.
NOT_USED_BY_A_RUN = ("sklearn", "scipy")
HIDDEN_WHILE_IMPORTING = ("bitsandbytes", *NOT_USED_BY_A_RUN)


@contextlib.contextmanager
def hidden_while_importing(names=HIDDEN_WHILE_IMPORTING):
    """Within the block, `names` look not installed where nothing imported them yet: None in sys.modules is Python's
    own "no such module", so `importlib.util.find_spec` (transformers' and peft's availability checks) answers None
    and an import raises ImportError, which their import-time code takes as not installed. Afterwards they import
    again; transformers keeps its cached answer for scikit-learn and scipy, as if they were not installed."""
    hidden = [name for name in names if name not in sys.modules]
    sys.modules.update(dict.fromkeys(hidden, None))
    try:
        yield
    finally:
        bring_back(hidden)


def skip_unused_libraries(model_arguments, training) -> None:
    """The run sees scikit-learn and scipy as not installed, and bitsandbytes unless it quantizes or trains with a
    bitsandbytes optimizer (as `skip_unused_deepspeed` does DeepSpeed); a run that uses bitsandbytes gets it back."""
    from transformers import trainer_optimizer

    optimizer = str(getattr(training.optim, "value", training.optim))
    # "8bit": GaLore's 8-bit AdamW too, whose package imports bitsandbytes itself
    uses_bitsandbytes = (model_arguments.load_in_4bit or model_arguments.load_in_8bit or "8bit" in optimizer
                         or optimizer in trainer_optimizer._BITSANDBYTES_OPTIMIZERS)
    if uses_bitsandbytes:
        bring_back(["bitsandbytes"])
    for name in NOT_USED_BY_A_RUN + (() if uses_bitsandbytes else ("bitsandbytes",)):
        sys.modules.setdefault(name, None)


def bring_back(names) -> None:
    """The libraries among `names` that were hidden import again; for bitsandbytes, the answers transformers and peft
    cached while it was hidden are forgotten (peft's LoRA asks whether it is installed each time it wraps a model)."""
    hidden = [name for name in names if sys.modules.get(name, False) is None]
    for name in hidden:
        del sys.modules[name]
    if "bitsandbytes" not in hidden:
        return
    availability_checks = [(sys.modules.get("peft.import_utils"), ("is_bnb_available", "is_bnb_4bit_available")),
                           (sys.modules.get("transformers.utils.import_utils"), ("is_bitsandbytes_available",))]
    for module, checks in availability_checks:
        for check in checks if module is not None else ():
            getattr(module, check).cache_clear()
