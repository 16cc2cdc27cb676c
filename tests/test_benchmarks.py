"""The benchmarks' tiny CPU modes run end to end, so scripts/bench.py and scripts/measure_memory.py do not rot between
GPU runs."""

import json
import os
import shutil
import subprocess
import sys
from functools import partial

import pytest

from tests.helpers import ROOT


@pytest.mark.launches
def test_tiny_bench_writes_every_case(tmp_path):
    from benchmarks.cases import gpu_cases

    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]

    report = json.loads((tmp_path / "bench.json").read_text())
    table = (tmp_path / "bench.md").read_text()
    cases = {case["key"]: case for case in report["cases"]}
    for case in gpu_cases():
        assert case.key in cases, f"{case.key} missing from bench.json"
        assert case.title in table, f"{case.title} missing from bench.md"
        results = {r["variant"]: r for r in cases[case.key]["results"]}
        for variant in case.variants:
            if variant.extra:
                continue  # GPU-only explorations (compiled layers, flex attention)
            result = results.get(variant.key)
            assert result is not None, f"{case.key}/{variant.key} missing"
            assert "error" not in result, f"{case.key}/{variant.key}: {result.get('error')}"
            assert result["tokens_per_s"] > 0 and result["step_time_median_s"] > 0
            assert result["timed_steps"] >= 2
            assert 0 < result["loss_last"] < 20
            assert result["lm_head_calls"] == 0, "the full-vocabulary logits were built (TRL's fused LM head unused)"
            if case.data == "fixed":
                assert 0 < result["mfu"] < 1
            if variant.recipe:
                assert result["command"].startswith(f"scripts/sft.py --config recipes/{variant.recipe}")
                assert result["planned_gib"] > 0
    numerics = report["numerics"]
    assert "error" not in numerics, numerics
    assert numerics["max_rel_diff"] < 0.02 and numerics["passed"]
    assert "Numerics check" in table


def test_every_compiled_variant_gets_a_process_of_its_own():
    from benchmarks.cases import compiles, gpu_cases, process_groups

    for case in gpu_cases():
        for extra in (False, True):
            groups = process_groups(case.variants, extra)
            grouped = sorted(variant.key for group in groups for variant in group)
            assert grouped == sorted(variant.key for variant in case.variants if variant.extra == extra)
            for group in groups:
                assert len(group) == 1 or not any(compiles(variant) for variant in group), (case.key, group)
    lora = {variant.key: variant for variant in next(c for c in gpu_cases() if c.key == "llama3b_lora").variants}
    assert compiles(lora["finetune"]) and not compiles(lora["finetune_eager"]) and not compiles(lora["plain_best"])


@pytest.mark.launches
def test_measure_memory_tiny_case_runs_on_cpu(tmp_path):
    pytest.importorskip("trl")
    out = subprocess.run([sys.executable, "scripts/measure_memory.py", "--tiny", "--out", str(tmp_path),
                          "--cases", "llama-3.2-1b-full-s1024-b8"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "planner_validation.json").read_text())
    assert rows[0]["case"] == "llama-3.2-1b-full-s1024-b8" and "error" not in rows[0]


def tiny_user_path_work(work):
    """benchmarks/user_path.py's work folder with the tiny Llama in place of the 1B model, and its chat rows."""
    from benchmarks import user_path
    from finetune.models import tiny

    user_path.write_chat_rows(work / "data", train_rows=16)  # two steps of two packed rows of 128 tokens
    shutil.copytree(tiny.tiny_model_folder("llama"), work / "llama1b")
    return user_path


@pytest.mark.launches
def test_user_path_times_a_fresh_launch_and_refuses_a_resumed_one(tmp_path):
    """One cheap CPU launch, into the case's output folder that a previous run left a checkpoint in: the benchmark
    empties it, so the run starts at step 0 and gives a row whose moments follow each other from the launch on. The
    same run's record, rewritten as a relaunch that resumed from checkpoint-1 would have left it, gives no row."""
    user_path = tiny_user_path_work(tmp_path)
    (tmp_path / "out" / "llama1b_full" / "checkpoint-5").mkdir(parents=True)
    row = user_path.run_case("llama1b_full", tmp_path, tmp_path, steps=2, timeout=240, accelerate_config="",
                             flags=("--max_length", "128", "--per_device_train_batch_size", "2",
                                    "--gradient_accumulation_steps", "1"))
    assert row["status"] == "ok", row
    moments = [row[f"seconds_launch_to_{moment}"] for moment in (*user_path.MOMENTS, "first_step", "last_step")]
    assert 0 < moments[0] and moments == sorted(moments), row
    assert row["steps"] == 2 and row["real_tokens"] > 0 and row["real_tokens_per_s_from_launch"] > 0
    assert row["compiled_graphs"] == 0 and row["compile_caches"] == "empty"

    output_dir = tmp_path / "out" / "llama1b_full"
    record_path = output_dir / "finetune_speed.json"
    record = json.loads(record_path.read_text())
    judge = partial(user_path.judge, "llama1b_full", 0, 240, record["process_start"] - 1, output_dir,
                    log_path=tmp_path / "llama1b_full.log")
    record_path.write_text(json.dumps({**record, "started_at_step": 1}))
    resumed = judge(steps=1)
    assert resumed["status"] == "resumed" and "started at step 1" in resumed["reason"], resumed
    assert set(resumed) == {"case", "status", "reason"}, "a refused run must carry no figures"
    record_path.write_text(json.dumps(record))
    assert judge(steps=3) == {"case": "llama1b_full", "status": "cut short",
                              "reason": "the run trained 2 of the 3 steps asked"}
    assert judge(steps=2)["status"] == "ok"
    failed = partial(user_path.judge, "llama1b_full", None, 240, 0.0, output_dir, 2, tmp_path / "llama1b_full.log")()
    assert failed["status"] == "cut short" and "still running after its 240 s" in failed["reason"]


def test_trace_summary_counts_the_gpu_busy_between_kernels_and_sums_them_by_name():
    from benchmarks.trace_summary import summarize

    def kernel(name, start, duration):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": duration}

    # a kernel inside another, a 500 us gap (the host's wait), a copy; CPU ops are not the GPU's time
    trace = {"traceEvents": [kernel("gemm", 0, 1000), kernel("add", 200, 300), kernel("gemm", 1500, 300),
                             {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 1800, "dur": 100},
                             {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]}
    summary = summarize(trace, top=2)
    assert (summary["gpu_span_ms"], summary["gpu_busy_ms"], summary["idle_gaps_over_100us_ms"]) == (1.9, 1.4, 0.5)
    assert summary["kernels_by_total_ms"] == [{"name": "gemm", "ms": 1.3, "calls": 2},
                                              {"name": "add", "ms": 0.3, "calls": 1}]
    with pytest.raises(SystemExit, match="no GPU kernel"):
        summarize({"traceEvents": [trace["traceEvents"][-1]]}, top=2)


def test_ahead_case_runs_sft_with_the_next_chunk_dequantized_ahead(tmp_path, monkeypatch, capsys):
    """user_path's case gptoss20b_resident_ckpt_ahead launches benchmarks/sft_dequantize_ahead.py, which runs
    scripts/sft.py (here as far as its --help) with the prefetch swapped for one that dequantizes ahead; the shipped one
    does not."""
    import runpy

    from benchmarks import user_path
    from finetune.models import mxfp4_experts

    assert mxfp4_experts.PREFETCH.ahead is False
    command = user_path.launch_command("gptoss20b_resident_ckpt_ahead", tmp_path, tmp_path / "out", "")
    script = next(part for part in command if part.endswith(".py"))
    assert script == str(ROOT / "benchmarks" / "sft_dequantize_ahead.py")
    monkeypatch.setattr(mxfp4_experts, "PREFETCH", mxfp4_experts.PREFETCH)
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(script, run_name="__main__")
    assert exited.value.code == 0 and "--dequantize_mxfp4" in capsys.readouterr().out
    assert mxfp4_experts.PREFETCH.ahead is True


def test_flags_given_to_user_path_override_the_cases_own(tmp_path):
    """`--flags` (gpu_lease.sh's FLAGS) come after a case's own flags, so the parser's last value is the one asked for:
    a lease that asked for a case without activation offloading once got it with offloading."""
    from benchmarks import user_path

    command = user_path.launch_command("gptoss20b_mxfp4_not_offloaded", tmp_path, tmp_path / "out", "",
                                       "--activation_offloading", "true")
    values = [command[index + 1] for index, part in enumerate(command) if part == "--activation_offloading"]
    assert values == ["false", "true"]
