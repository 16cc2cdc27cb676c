"""Training from Python and tracking in MLflow: `finetune.launch` starts two CPU processes and returns what they
trained, logging to a local MLflow store; `finetune.train` then resumes that run in this process and continues the
same MLflow run. One launch and one in-process run are shared by every test here."""

import json
import logging.handlers
import os
import signal
import sys

import pytest

from tests.helpers import ROOT, free_port

pytestmark = [pytest.mark.launches, pytest.mark.xdist_group("test_api")]  # one worker: its runs are module fixtures

LORA = str(ROOT / "recipes" / "llama-3.2-1b" / "lora.yaml")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    saved = dict(os.environ)
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{folder / 'mlflow.db'}"
    cwd = os.getcwd()
    os.chdir(folder)  # MLflow keeps artifacts in ./mlruns beside a sqlite store
    yield folder
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def launched(store):
    """Four steps in two processes, then two more in this one; what MLflow logged as errors, and whether the in-process
    run left the environment as it found it."""
    import mlflow  # before its loggers are watched: importing mlflow replaces their handlers

    import finetune

    # held-out scores before/after training are tested in tests/test_inference.py; here they would only cost time
    common = {"tiny": True, "save_steps": 4, "logging_steps": 1, "output_dir": str(store / "out"), "report_to": "mlflow",
              "eval_samples_before_after": 0}
    first = finetune.launch(config=LORA, num_processes=2, accelerate_config=str(ROOT / "accelerate_configs" / "ddp.yaml"),
                            main_process_port=free_port(), max_steps=4, **common)
    errors = logging.handlers.BufferingHandler(capacity=1000)
    errors.setLevel(logging.ERROR)
    logging.getLogger(mlflow.__name__).addHandler(errors)
    environment, handler = dict(os.environ), signal.getsignal(signal.SIGTERM)
    try:
        resumed = finetune.train(config=LORA, max_steps=6, **common)
    finally:
        logging.getLogger(mlflow.__name__).removeHandler(errors)
    kept = dict(os.environ) == environment and signal.getsignal(signal.SIGTERM) == handler
    return first, resumed, [record.getMessage() for record in errors.buffer], kept


def test_import_finetune_loads_neither_torch_nor_trl():
    import subprocess

    code = "import finetune, sys; print(sorted({'torch', 'trl', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip() == "[]"


def test_launch_trains_two_processes_and_returns_the_output_folder_and_final_metrics(launched, store):
    first, *_ = launched
    assert first.output_dir == store / "out"
    assert first.metrics["step"] == 4 and "train_loss" in first.metrics and "eval_loss" in first.metrics
    state = json.loads((store / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["train_batch_size"] * 2 == 16, "two processes of 8 rows each trained together"


def test_train_runs_in_this_process_and_resumes_the_launched_run(launched, store):
    _, resumed, _, environment_kept = launched
    assert resumed.output_dir == store / "out"
    assert resumed.metrics["step"] == 6
    assert [entry["step"] for entry in resumed.log_history if "loss" in entry] == [1, 2, 3, 4, 5, 6]
    assert environment_kept, "the kernel's next run would inherit this run's variables or SIGTERM handler"


def the_one_mlflow_run():
    import mlflow

    client = mlflow.MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([exp.experiment_id for exp in client.search_experiments()])
    return client, run


def test_mlflow_store_holds_recipe_setup_every_step_and_artifacts_of_one_continued_run(launched, store):
    client, run = the_one_mlflow_run()
    assert run.info.run_name == str(store / "out")
    assert run.data.params["recipe.lora_r"] == "16" and run.data.params["recipe.tiny"] == "True"
    # the setup is the latest launch's: the in-process resume ran as a single process
    assert run.data.tags["setup.strategy"] == "single" and run.data.tags["setup.world_size"] == "1"
    assert [metric.step for metric in client.get_metric_history(run.info.run_id, "loss")] == [1, 2, 3, 4, 5, 6]
    artifacts = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"loss.png", "finetune_run.json", "finetune_data.json", "setup.json"} <= artifacts
    assert json.loads((store / "out" / "mlflow_run.json").read_text())["run_id"] == run.info.run_id


def test_a_relaunch_for_more_steps_keeps_the_first_param_tags_the_new_value_and_logs_no_error(launched, store):
    *_, mlflow_errors, _ = launched
    _, run = the_one_mlflow_run()
    assert mlflow_errors == []
    assert run.data.params["max_steps"] == "4" and run.data.params["recipe.max_steps"] == "4"
    assert run.data.tags["relaunch.max_steps"] == "6" and run.data.tags["relaunch.recipe.max_steps"] == "6"
    assert run.data.params["learning_rate"] == "0.0002", "the training arguments are logged once"


def test_a_launch_that_fails_raises_the_one_sentence_and_nothing_else(store, capfd):
    import finetune
    from finetune.errors import UserError

    with pytest.raises(UserError, match=r"^recipe: `dataset_mixture` needs `datasets:`") as error:
        finetune.launch(config=LORA, tiny=True, output_dir=str(store / "refused"), dataset_mixture={"seed": 1})
    _, err = capfd.readouterr()
    assert "Traceback" not in err and "CalledProcessError" not in err
    assert err.count(str(error.value)) == 1


def test_mlflow_asked_for_but_not_installed_is_one_sentence_before_loading(monkeypatch):
    from trl import SFTConfig

    from finetune.checks import recipe as recipe_checks
    from finetune.errors import UserError

    monkeypatch.setattr(recipe_checks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r'recipe.yaml: `report_to: mlflow` needs the mlflow package.*\[mlflow\]'):
        recipe_checks.check_mlflow_installed(SFTConfig(output_dir="unused", report_to="mlflow", use_cpu=True), "recipe.yaml")
