"""Evaluation: the zero-shot classifier (`classifier`), metrics, benchmark readers (`readers`) and
the split they read (`eval_data`), the image-feature cache (`features`), prompts, one benchmark
(`benchmark`), the suite (`suite`) and its reports, linear and few-shot probes (`probes`), and
routing inspection (`routing`)."""
from lit_softmoe.evals.classifier import build_zeroshot_classifier
from lit_softmoe.evals.metrics import (
    mean_per_class_recall,
    retrieval_metrics,
    topk_accuracy,
    zeroshot_metrics,
)

__all__ = ["build_zeroshot_classifier", "mean_per_class_recall", "retrieval_metrics",
           "topk_accuracy", "zeroshot_metrics"]
