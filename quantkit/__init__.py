"""quantkit: W8A8 (INT8 / FP8) quantization of Hugging Face causal LMs on Triton kernels."""

from quantkit.api import (
    Comparison,
    check_dataset,
    compare_perplexity,
    prepare_calibration_data,
    prepare_evaluation_tokens,
    quantize,
)
from quantkit.checkpoint import (
    CheckpointError,
    check_output_dir,
    is_quantized_checkpoint,
    load,
    load_tokenizer,
    read_quant_config,
    save,
)
from quantkit.config import QuantConfig, UnknownSchemeError
from quantkit.eval import PerplexityResult, evaluate_perplexity
from quantkit.models.loading import BUNDLED_MODEL, ModelLoadError, load_model, resolve_device, write_json
from quantkit.calibration.data import BUNDLED_DATASET, DatasetError
from quantkit.generate import generate as generate_tokens
from quantkit.models.fast_path import optimize
from quantkit.models.graphed import graphed
from quantkit.nn import QuantLinear


def quantized_modules(model):
    """The QuantLinear modules of a model (empty for a 16-bit model)."""
    return (m for m in model.modules() if isinstance(m, QuantLinear))


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
    "check_dataset",
    "check_output_dir",
    "compare_perplexity",
    "evaluate_perplexity",
    "generate_tokens",
    "graphed",
    "is_quantized_checkpoint",
    "load_tokenizer",
    "optimize",
    "quantized_modules",
    "load",
    "load_model",
    "prepare_calibration_data",
    "prepare_evaluation_tokens",
    "quantize",
    "read_quant_config",
    "resolve_device",
    "save",
    "write_json",
]
