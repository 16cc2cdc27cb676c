"""The real architectures of the recipes' models, kept in the project because there may be no hub to ask.

The JSON files in `model_configs/` are the `config.json` of each hub checkpoint (quantization left out); the planner,
the benchmark and the tiny-model path read them from here.
"""

import json
from pathlib import Path

MODEL_CONFIGS_DIR = Path(__file__).parent / "model_configs"

HUB_ID_TO_ARCHITECTURE = {
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b",
    "meta-llama/Llama-3.2-3B": "llama-3.2-3b",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
}


def known_architecture(model_name_or_path: str) -> str | None:
    """The name of the stored architecture for a hub id or an architecture name, or None when it is not one of ours."""
    if model_name_or_path in HUB_ID_TO_ARCHITECTURE:
        return HUB_ID_TO_ARCHITECTURE[model_name_or_path]
    if (MODEL_CONFIGS_DIR / f"{model_name_or_path}.json").is_file():
        return model_name_or_path
    return None


def config_values(model_name_or_path: str) -> tuple[str, dict]:
    """The name and the config.json values of a model: the stored copy for known models, else a local folder's.
    Plain JSON, so the planner reads it without transformers. ValueError when neither exists (never downloads)."""
    name = known_architecture(model_name_or_path)
    if name is not None:
        return name, json.loads((MODEL_CONFIGS_DIR / f"{name}.json").read_text())
    local = Path(model_name_or_path) / "config.json"
    if local.is_file():
        return Path(model_name_or_path).name, json.loads(local.read_text())
    raise ValueError(
        f"Unknown model {model_name_or_path!r}: not one of {sorted(HUB_ID_TO_ARCHITECTURE)} and no config.json there."
    )


def load_architecture(model_name_or_path: str):
    """The model's transformers config, from the stored copies for known models or from a local folder.

    transformers is imported here, not at the top, so that the planner can use this module and still answer at once."""
    from transformers import AutoConfig

    if known_architecture(model_name_or_path) is None:
        return AutoConfig.from_pretrained(model_name_or_path)
    _, values = config_values(model_name_or_path)
    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def model_family(model_name_or_path: str) -> str:
    """'llama' or 'gpt-oss': which tiny model stands in for this one, and which chat template it speaks."""
    config_file = Path(model_name_or_path) / "config.json"
    if config_file.is_file():
        model_type = json.loads(config_file.read_text()).get("model_type")
        return {"gpt_oss": "gpt-oss"}.get(model_type, "llama")
    return "gpt-oss" if "gpt-oss" in model_name_or_path.lower() else "llama"
