"""The benchmarks' tiny CPU modes run end to end, so scripts/bench.py and scripts/measure_memory.py do not rot between
GPU runs."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


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


def test_measure_memory_tiny_case_runs_on_cpu(tmp_path):
    pytest.importorskip("trl")
    out = subprocess.run([sys.executable, "scripts/measure_memory.py", "--tiny", "--out", str(tmp_path),
                          "--cases", "llama-3.2-1b-full-s1024-b8"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = json.loads((tmp_path / "planner_validation.json").read_text())
    assert rows[0]["case"] == "llama-3.2-1b-full-s1024-b8" and "error" not in rows[0]
