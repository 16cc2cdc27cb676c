"""The setup line (`[finetune] setup: {...}`, finetune/run/trainer.py `describe_setup`) shows how the layers are
checkpointed as found on the prepared model, not as asked; an accelerate config whose activation checkpointing
wrapped no layer stops the run before its first step. In this process, on the tiny Llama."""

from functools import partial
from types import SimpleNamespace

import pytest
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import AutoModelForCausalLM

from finetune import patches
from finetune.config.launch_request import ExportedLaunch
from finetune.models import tiny
from finetune.models.compilation import CompileInsideCheckpoints
from finetune.run.trainer import checkpointing_problem
from tests.helpers import ROOT, printed_setup

FULL = ROOT / "recipes" / "llama-3.2-1b" / "full.yaml"


@pytest.mark.parametrize("checkpointing, found", [(True, "transformers"), (False, "none")])
def test_the_setup_line_shows_the_checkpointing_found_on_the_prepared_model(checkpointing, found, tmp_path, capfd):
    import finetune

    finetune.train(config=FULL, tiny=True, gradient_checkpointing=checkpointing, max_steps=1, eval_strategy="no",
                   save_strategy="no", eval_samples_before_after=0, report_to="none", output_dir=str(tmp_path / "out"))
    assert printed_setup(capfd.readouterr().out)["activation_checkpointing"] == found


def tiny_llama():
    return AutoModelForCausalLM.from_pretrained(tiny.tiny_model_folder("llama"))


def test_layers_compiled_inside_their_checkpoints_are_found_so():
    model = tiny_llama()
    model.gradient_checkpointing_enable()
    CompileInsideCheckpoints(backend="eager", mode=None).on_train_begin(None, None, None, model=model)
    assert patches.activation_checkpointing_found(model) == "transformers, compiled inside"


def fsdp_checkpointed(layer_classes: list[str] | None):
    """The tiny Llama as accelerate's `fsdp_activation_checkpointing: true` leaves it under FSDP2 (fsdp2_apply_ac,
    before sharding), its transformer-based wrap policy naming `layer_classes` (None: the model's decoder layers)."""
    from accelerate.utils import fsdp2_apply_ac

    plugin = SimpleNamespace(auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls=set()),
                             transformer_cls_names_to_wrap=layer_classes, activation_checkpointing_offload=False)
    return fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin)), tiny_llama())


FSDP_FILE = ExportedLaunch("fsdp", "fsdp_checkpointed.yaml", None, None, 2, fsdp_activation_checkpointing=True)


def test_the_setup_line_finds_the_checkpoints_an_fsdp_file_wraps_the_layers_in():
    found = patches.activation_checkpointing_found(fsdp_checkpointed(None))
    assert found == "fsdp"
    assert checkpointing_problem({"activation_checkpointing": found}, FSDP_FILE) is None


def test_an_fsdp_file_whose_checkpointing_wrapped_no_layer_stops_the_run_before_its_first_step(monkeypatch):
    from finetune.run import trainer

    found = patches.activation_checkpointing_found(fsdp_checkpointed([]))
    assert found == "none"
    setup = {"world_size": 2, "strategy": "fsdp", "wrapper": "FSDPLlamaForCausalLM", "activation_checkpointing": found}
    monkeypatch.setattr(trainer, "describe_setup", lambda _: setup)
    prepared = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=False))
    with pytest.raises(trainer.SetupMismatch) as stopped:
        trainer.SetupCheck(prepared, FSDP_FILE).on_train_begin(None, None, None)
    assert str(stopped.value).startswith(
        "fsdp_checkpointed.yaml: `fsdp_activation_checkpointing: true` checkpointed no layer of the model (activation "
        "checkpointing found: none); make `fsdp_auto_wrap_policy` wrap the decoder layers")
    not_asked = ExportedLaunch("fsdp", "fsdp.yaml", None, None, 2, fsdp_activation_checkpointing=False)
    trainer.SetupCheck(prepared, not_asked).on_train_begin(None, None, None)


def test_the_fsdp_files_checkpointing_is_read_from_what_accelerate_launch_exports(monkeypatch):
    from finetune.config.launch_request import read_exported_launch

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    assert read_exported_launch().fsdp_activation_checkpointing
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "false")
    assert not read_exported_launch().fsdp_activation_checkpointing
