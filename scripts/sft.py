"""Supervised fine-tuning: parse the recipe, check it, load data and model, train, save.

    accelerate launch [--config_file accelerate_configs/NAME.yaml] scripts/sft.py --config recipes/MODEL/METHOD.yaml [--tiny]

With no arguments it trains the tiny Llama on the bundled sample data (see finetune/config.py DEFAULT_ARGS).
"""

from finetune import config, data, model, train
from finetune.errors import exit_on_user_error


def prepare(argv: list[str] | None = None):
    """Parse, check, load: the run, its trainer ready to train, and the tokenizer."""
    run = config.parse_args(argv)
    config.apply_to_process(run)
    config.check(run)
    model_path = model.resolve_model_path(run)
    tokenizer = model.load_tokenizer(model_path, run.training.assistant_only_loss)
    model.check_lora_targets(run, model_path)
    train_set, eval_set = data.load_datasets(run.script, run.training, None if run.finetune.truncation else tokenizer,
                                             run.finetune, record=run.data_sources, tokenizer=tokenizer)
    config.check_data_unchanged(run, train_set)
    trainer = train.build_trainer(run, model.load_model(run, model_path), tokenizer, train_set, eval_set)
    return run, trainer, tokenizer


def main(argv: list[str] | None = None) -> None:
    run, trainer, tokenizer = prepare(argv)
    train.train_and_save(trainer, run, tokenizer)
    train.finish_run(trainer)

if __name__ == "__main__":
    exit_on_user_error(main)
