from quantkit.nn.linear import QuantLinear

__all__ = ["QuantLinear"]
