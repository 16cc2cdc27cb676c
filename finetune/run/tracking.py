"""MLflow, when `report_to` names it. transformers' MLflowCallback starts the run and logs the training arguments and
every logged step's metrics; this adds what it does not: the recipe as the user wrote it (flattened into
`recipe.<key>` params), the setup line, the loss plot and the run records as artifacts, a run named after the output
folder, and a relaunch that continues the same MLflow run (its id kept in the output folder, handed to the callback
through MLFLOW_RUN_ID, which it reads). MLflow refuses to change a logged param, so a relaunch that changes a value
(more steps) keeps the first launch's value as the param and records the new one as a `relaunch.<key>` tag.

    pip install -e ".[mlflow]"; export MLFLOW_TRACKING_URI=sqlite:///mlflow.db   (a local store, no server)
"""

import json
import os
from pathlib import Path

from transformers import TrainerCallback

from finetune.errors import say

MLFLOW_RUN_FILE = "mlflow_run.json"


def wanted(training) -> bool:
    return "mlflow" in (training.report_to or [])


def recorded_run(training) -> Path | None:
    """The output folder's record of the MLflow run an earlier launch started, if any."""
    recorded = Path(training.output_dir) / MLFLOW_RUN_FILE
    return recorded if recorded.is_file() else None


def prepare(training) -> None:
    """Name the MLflow run after the output folder, and continue the output folder's MLflow run on a relaunch."""
    if not wanted(training):
        return
    if training.run_name is None:
        training.run_name = training.output_dir
    recorded = recorded_run(training)
    if recorded is not None and "MLFLOW_RUN_ID" not in os.environ:
        os.environ["MLFLOW_RUN_ID"] = json.loads(recorded.read_text())["run_id"]
        # MLflowCallback logs every training argument again, in the background, and MLflow rejects the whole batch with
        # an ERROR line when one value changed (max_steps, on a relaunch for more steps): it logs none now (its
        # documented knob), and MlflowRecord logs those not logged yet and tags the changed ones.
        os.environ["MLFLOW_MAX_LOG_PARAMS"] = "0"


def flatten(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and any(isinstance(item, dict) for item in value):
            flat.update(flatten(dict(enumerate(value)), f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_values(run) -> dict:
    """The keys the recipe and the command line set, with the values the run uses."""
    values = {}
    for key in sorted(run.explicit_keys):
        for arguments in (run.finetune, run.training, run.model, run.script):
            if hasattr(arguments, key):
                value = getattr(arguments, key)
                values[key] = json.loads(value) if isinstance(value, str) and value.startswith("{") else value
                break
    return values


class MlflowRecord(TrainerCallback):
    """Once MLflowCallback has started the run: the recipe as params, the setup as tags, the run id in the output
    folder. Runs after the setup check, so the setup it records is the checked one. On a relaunch that continues the
    run, also the training arguments and model config MLflowCallback was told not to log again (`prepare`)."""

    def __init__(self, run, setup_check):
        self.run = run
        self.setup_check = setup_check
        self.continued = recorded_run(run.training) is not None  # before this launch writes the record

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        active = mlflow.active_run()
        if not state.is_world_process_zero or active is None:
            return
        logged = mlflow.get_run(active.info.run_id).data.params
        values = {f"recipe.{key}": value for key, value in flatten(recipe_values(self.run)).items()}
        if self.continued:  # what MLflowCallback logs on a first launch
            config = model.config.to_dict() if getattr(model, "config", None) is not None else {}
            values.update({**config, **args.to_dict()})
        params = {key: str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in values.items()}
        mlflow.log_params({key: value for key, value in params.items() if key not in logged})
        changed = {key: value for key, value in params.items() if key in logged and logged[key] != value}
        if changed:
            mlflow.set_tags({f"relaunch.{key}": value for key, value in changed.items()})
            say(f"MLflow keeps a run's first value of a param; this launch's values are its relaunch.* "
                  f"tags: {', '.join(f'{key} {logged[key]} -> {value}' for key, value in changed.items())}")
        if self.setup_check.setup is not None:
            mlflow.set_tags({f"setup.{key}": str(value) for key, value in self.setup_check.setup.items()})
            mlflow.log_dict(self.setup_check.setup, "setup.json")
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        record = {"run_id": active.info.run_id, "tracking_uri": mlflow.get_tracking_uri()}
        (Path(args.output_dir) / MLFLOW_RUN_FILE).write_text(json.dumps(record, indent=2) + "\n")


def log_outputs(training, files: list[Path]) -> None:
    """After the final save (MLflowCallback has ended the run by then): the loss plot and run records as artifacts."""
    recorded = Path(training.output_dir) / MLFLOW_RUN_FILE
    if not wanted(training) or not recorded.is_file():
        return
    import mlflow

    with mlflow.start_run(run_id=json.loads(recorded.read_text())["run_id"]):
        for path in files:
            if path.is_file():
                mlflow.log_artifact(str(path))
