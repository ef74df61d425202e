"""Zero-shot classification: class prompts → text classifier → top-k accuracy."""
from lit_softmoe.zeroshot.classifier import build_zeroshot_classifier, topk_accuracy, zeroshot_metrics

__all__ = ["build_zeroshot_classifier", "topk_accuracy", "zeroshot_metrics"]
