"""Group-wise 4-bit compression: a frozen `QuantConfig`, the `QTensor` value type, quantize/dequantize."""
from engine.quant.config import QuantConfig
from engine.quant.group import dequantize, quantize
from engine.quant.qtensor import QTensor, empty_qtensor, qtensor_nbytes

__all__ = ["QuantConfig", "QTensor", "quantize", "dequantize", "empty_qtensor", "qtensor_nbytes"]
