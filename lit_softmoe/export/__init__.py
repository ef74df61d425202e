"""Export a LiT pair (or a pretrained image tower) as one folder other programs load: safetensors +
config.json + tokenizer files (+ ONNX graphs checked against PyTorch) + a model card."""
from lit_softmoe.export.pair import export_pair

__all__ = ["export_pair"]
