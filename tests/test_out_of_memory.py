"""Running out of GPU memory ends in one sentence: the step, the memory, and the change that fits the recipe. On a CPU
the out-of-memory error is raised by a patched training step, in this process (the imports are paid once)."""

import runpy
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import ROOT

LORA = ROOT / "recipes" / "llama-3.2-3b" / "lora.yaml"


def test_out_of_memory_in_a_step_is_one_sentence_with_the_fix(tmp_path, capfd, monkeypatch):
    from finetune.run import out_of_memory
    from finetune.run.trainer import FinetuneTrainer

    def training_step(trainer, *args, **kwargs):
        if trainer.state.global_step == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")
        return torch.tensor(1.0)

    monkeypatch.setattr(FinetuneTrainer, "training_step", training_step)
    monkeypatch.setattr(out_of_memory, "gpu_memory_gib", lambda: (74.0, 79.2))
    script = str(ROOT / "scripts" / "sft.py")
    monkeypatch.setattr(sys, "argv", [script, "--config", str(LORA), "--tiny", "--max_steps", "3",
                                      "--output_dir", str(tmp_path / "out"), "--eval_strategy", "no",
                                      "--save_strategy", "no", "--eval_samples_before_after", "0"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(script, run_name="__main__")
    err = capfd.readouterr().err
    assert exit.value.code == 2
    assert "Traceback" not in err and "OutOfMemoryError" not in err
    assert (f"error: {LORA}: the run ran out of GPU memory in step 2 (74.0 GiB held by its tensors at the peak, of "
            f"the GPU's 79.2 GiB); add --gradient_checkpointing true, or see what fits this GPU with `finetune plan "
            f"--config {LORA} --gpu-memory 79`.") in err


@pytest.mark.parametrize("checkpointing, batch, fix", [
    (True, 4, "halve the micro-batch with --per_device_train_batch_size 2 --gradient_accumulation_steps 8"),
    (True, 1, "lower --max_length below 2048"),
])
def test_out_of_memory_with_checkpointing_on_halves_the_micro_batch_then_the_rows(checkpointing, batch, fix):
    from finetune.run.out_of_memory import smaller_setting

    training = SimpleNamespace(gradient_checkpointing=checkpointing, per_device_train_batch_size=batch,
                               gradient_accumulation_steps=4, max_length=2048)
    assert smaller_setting(training).startswith(fix)
