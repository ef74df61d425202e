"""Zero-shot evaluation: class prompts → text classifier, metrics, benchmark readers, the suite runner."""
from lit_softmoe.zeroshot.classifier import build_zeroshot_classifier
from lit_softmoe.zeroshot.metrics import (mean_per_class_recall, retrieval_metrics, topk_accuracy,
                                          zeroshot_metrics)

__all__ = ["build_zeroshot_classifier", "mean_per_class_recall", "retrieval_metrics", "topk_accuracy",
           "zeroshot_metrics"]
