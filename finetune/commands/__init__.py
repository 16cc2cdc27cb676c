"""One module per `finetune` subcommand, its parser beside its runner."""
