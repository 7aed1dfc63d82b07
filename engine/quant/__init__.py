"""Weight quantization methods for engine/layers/linear.py: FP8 (fp8.py) and the choice of its
kernels by measurement (fp8_kernels.py). `linear_method` maps a runtime.quantization.WeightQuant
and a module name to the method that module's Linear uses."""

from __future__ import annotations

from engine.layers.linear import LinearMethod
from runtime.errors import InvalidRequest
from runtime.quantization import FP8, WeightQuant

_DENSE = LinearMethod()


def linear_methods(quant: WeightQuant | None):
    """A function (HF module names of one Linear) → its LinearMethod, for a model quantized as
    `quant` (None: all in the model dtype). One method object per kind, shared by the layers (it
    keeps the kernel choices per shape). A quantized lm_head is dequantized at load: the logits are
    computed in float32 from a model-dtype weight (engine/model.py compute_logits)."""
    if quant is None:
        return lambda modules: _DENSE
    assert quant.method == FP8, quant
    from engine.quant.fp8 import Fp8LinearMethod
    fp8, fp8_head = Fp8LinearMethod(quant.serialized), Fp8LinearMethod(quant.serialized, dequantize=True)

    def method_for(modules: tuple[str, ...]) -> LinearMethod:
        quantized = {quant.quantizes(m) for m in modules}
        if len(quantized) > 1:
            raise InvalidRequest(f"the checkpoint quantizes some of {list(modules)} and not the others; "
                                 "fused projections must agree")
        if not quantized.pop():
            return _DENSE
        return fp8_head if modules == ("lm_head",) else fp8
    return method_for
