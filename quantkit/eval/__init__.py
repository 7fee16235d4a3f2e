from quantkit.eval.perplexity import PerplexityResult, evaluate_perplexity

__all__ = ["PerplexityResult", "evaluate_perplexity"]
