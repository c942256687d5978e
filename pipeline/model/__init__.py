"""Loading a model: weights, quantisation, placement, the tensor-parallel launch."""
