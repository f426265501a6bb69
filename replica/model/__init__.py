"""The torch model: HF config and weights, the decoder layers, attention, and the runner that steps it."""
