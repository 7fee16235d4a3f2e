"""quantkit: W8A8 (INT8 / FP8) quantization of Hugging Face causal LMs on Triton kernels."""

from quantkit.api import (
    Comparison,
    compare_perplexity,
    prepare_calibration_data,
    prepare_evaluation_tokens,
    quantize,
)
from quantkit.checkpoint import CheckpointError, load, read_quant_config, save
from quantkit.config import QuantConfig, UnknownSchemeError
from quantkit.eval import PerplexityResult, evaluate_perplexity
from quantkit.models.loading import BUNDLED_MODEL, ModelLoadError, load_model
from quantkit.calibration.data import BUNDLED_DATASET, DatasetError

__version__ = "0.1.0"

__all__ = [
    "BUNDLED_DATASET",
    "BUNDLED_MODEL",
    "CheckpointError",
    "Comparison",
    "DatasetError",
    "ModelLoadError",
    "PerplexityResult",
    "QuantConfig",
    "UnknownSchemeError",
    "compare_perplexity",
    "evaluate_perplexity",
    "load",
    "load_model",
    "prepare_calibration_data",
    "prepare_evaluation_tokens",
    "quantize",
    "read_quant_config",
    "save",
]
