"""One supervised fine-tuning run, as functions: configure (parse, apply, check) → load (tokenizer, data, model) →
build the trainer → train and save. `scripts/sft.py`, `finetune.train(...)` and the benchmarks call these; nothing
else rebuilds the run's order.

    accelerate launch [--config_file accelerate_configs/NAME.yaml] scripts/sft.py --config recipes/MODEL/METHOD.yaml

With no arguments it trains the tiny Llama on the bundled sample data (finetune/run/arguments.py DEFAULT_ARGS).
"""

from __future__ import annotations

from finetune import patches

# bitsandbytes, scikit-learn and scipy stay out of the process while transformers and peft are imported, which import
# them whenever they are installed (2.4 s of 7.6 s on an H100 machine); a run that uses bitsandbytes gets it back
# (arguments.apply_to_process)
with patches.hidden_while_importing():
    from finetune import run_folder
    from finetune.checks import model_folder, relaunch
    from finetune.checks import recipe as recipe_checks
    from finetune.data import load as data
    from finetune.models import compilation
    from finetune.run import arguments, model, speed
    from finetune.run import trainer as training
    from finetune.run.arguments import RunConfig


def configure(argv: list[str] | None = None) -> RunConfig:
    """The recipe and flags parsed, the process set up for them, every check that needs no model: before any load."""
    run = arguments.parse_args(argv)
    arguments.apply_to_process(run)
    recipe_checks.check(run)
    return run


def prepare(argv: list[str] | None = None):
    """Configure, take the output folder (one launch at a time), then load: the run, its trainer ready to train, and
    the tokenizer."""
    speed.mark("imports_done")
    run = configure(argv)
    if run_folder.is_main():
        run_folder.take_lock(run.training.output_dir)
    try:
        model_path = model_folder.resolve_model_path(run)
        model_folder.check_layers(run, model_path)
        tokenizer = model.load_tokenizer(model_path, run.training.assistant_only_loss)
        train_set, eval_set = data.load_datasets(run.script, run.training, None if run.finetune.truncation else tokenizer,
                                                 run.finetune, record=run.data_sources, tokenizer=tokenizer)
        relaunch.check_data_unchanged(run, train_set)
        recipe_checks.check_trains_something(run, len(train_set))
        compilation.compile_only_if_it_pays(run, model_path, len(train_set))
        loaded = model.load_model(run, model_path)
        speed.mark("model_loaded")  # on the GPU where it loads there (quantized, MXFP4), else on the CPU
        trainer = training.build_trainer(run, loaded, tokenizer, train_set, eval_set)
        speed.mark("model_on_device")  # the Trainer has tokenized the rows and moved the model to its device
    except BaseException:  # refused or failed while loading: the folder is left as it was found
        run_folder.release_lock(run.training.output_dir)
        raise
    return run, trainer, tokenizer


def main(argv: list[str] | None = None):
    """The whole run: prepare, train, save the final model, close the processes; the run and its trainer."""
    run, trainer, tokenizer = prepare(argv)
    try:
        training.train_and_save(trainer, run, tokenizer)
    finally:
        run_folder.release_lock(run.training.output_dir)
    training.finish_run(trainer)
    return run, trainer
