"""lit_softmoe.evals.metrics: top-k, mean per-class recall and retrieval recall on hand-built logits and
embeddings."""
import pytest
import torch
import torch.nn.functional as F

from lit_softmoe.evals import mean_per_class_recall, retrieval_metrics, topk_accuracy, zeroshot_metrics


def test_zero_shot_classifies_embeddings_near_their_class_vector():
    # Classifier = identity over 6 classes; images are noisy copies of their class's one-hot.
    dim = classes = 6
    classifier = torch.eye(dim)
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(classes).repeat(5)  # (30,)
    images = F.normalize(F.one_hot(labels, dim).float() + 0.05 * torch.randn(30, dim, generator=g), dim=-1)
    metrics = zeroshot_metrics(images, labels, classifier)
    assert metrics == {"top1": 1.0, "mean_per_class_recall": 1.0, "top5": 1.0}
    # Fewer than 5 classes: no top-5 (it would be 1 by definition).
    assert set(zeroshot_metrics(images[:, :4], labels % 4, torch.eye(4))) == {"top1", "mean_per_class_recall"}


def test_topk_on_hand_built_logits():
    logits = torch.tensor([
        [0.9, 0.5, 0.1, 0.0, -1.0, -2.0],  # label 0: rank 1
        [0.9, 0.5, 0.1, 0.0, -1.0, -2.0],  # label 2: rank 3
        [0.9, 0.5, 0.1, 0.0, -1.0, -2.0],  # label 4: rank 5
        [0.9, 0.5, 0.1, 0.0, -1.0, -2.0],  # label 5: rank 6
    ])
    labels = torch.tensor([0, 2, 4, 5])
    assert topk_accuracy(logits, labels, 1) == 0.25
    assert topk_accuracy(logits, labels, 3) == 0.5
    assert topk_accuracy(logits, labels, 5) == 0.75
    assert topk_accuracy(logits, labels, 10) == 1.0  # k past the class count: every class counts


def test_imbalanced_classes_separate_top1_from_mean_per_class_recall():
    # 8 images of class 0, 2 of class 1, 2 of class 2; the classifier says "class 0" for all but
    # one class-2 image. top-1 = 9/12; recalls per class: 1, 0, 1/2 → mean 1/2.
    labels = torch.tensor([0] * 8 + [1] * 2 + [2] * 2)
    predictions = torch.tensor([0] * 8 + [0, 0] + [0, 2])
    logits = F.one_hot(predictions, 3).float()
    assert topk_accuracy(logits, labels, 1) == pytest.approx(9 / 12)
    assert mean_per_class_recall(logits, labels) == pytest.approx(0.5)
    metrics = zeroshot_metrics(F.normalize(logits, dim=-1), labels, torch.eye(3))
    assert metrics["top1"] == pytest.approx(0.75) and metrics["mean_per_class_recall"] == pytest.approx(0.5)


@pytest.mark.filterwarnings("ignore:y_pred contains classes not in y_true")
def test_mean_per_class_recall_is_balanced_accuracy():
    # The CLIP_benchmark definition (sklearn's balanced accuracy): classes never in the labels
    # (here class 4, which is sometimes predicted) do not count.
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (200,), generator=g)
    logits = torch.randn(200, 5, generator=g) + 1.5 * F.one_hot(labels, 5)
    assert (logits.argmax(1) == 4).any()
    want = sklearn_metrics.balanced_accuracy_score(labels.numpy(), logits.argmax(1).numpy())
    assert mean_per_class_recall(logits, labels) == pytest.approx(want, abs=1e-6)


# ---- metrics on hand-computed cases ---------------------------------------------------------------

def test_ties_go_to_the_lower_class_index():
    # Row 0: classes 1 and 2 tie for first → prediction 1 (the lower index), so label 1 is a top-1
    # hit and label 2 is not; with k=2 both are hits. Row 1: all four tie → ranking 0, 1, 2, 3.
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    assert topk_accuracy(logits, torch.tensor([1, 0]), 1) == 1.0
    assert topk_accuracy(logits, torch.tensor([2, 1]), 1) == 0.0
    assert topk_accuracy(logits, torch.tensor([2, 1]), 2) == 1.0
    assert topk_accuracy(logits, torch.tensor([2, 3]), 2) == 0.5
    assert topk_accuracy(logits, torch.tensor([2, 3]), 3) == 0.5


def test_mean_per_class_recall_leaves_out_classes_absent_from_the_split():
    # 4 classes, but class 3 never occurs as a label (it is still predicted once: a wrong guess).
    # Class 0: 2 of 3 right; class 1: 1 of 1; class 2: 0 of 2 → (2/3 + 1 + 0) / 3.
    predictions = torch.tensor([0, 0, 3, 1, 0, 1])
    labels = torch.tensor([0, 0, 0, 1, 2, 2])
    logits = torch.nn.functional.one_hot(predictions, 4).float()
    assert mean_per_class_recall(logits, labels) == pytest.approx((2 / 3 + 1 + 0) / 3)
    assert topk_accuracy(logits, labels, 1) == pytest.approx(3 / 6)


def test_top5_only_with_five_or_more_classes():
    embeddings = F.normalize(torch.eye(4), dim=-1)
    four = zeroshot_metrics(embeddings, torch.arange(4), torch.eye(4))
    assert set(four) == {"top1", "mean_per_class_recall"} and four["top1"] == 1.0
    # Five classes: the image's label 4 is ranked last of five (top-5 hit, top-1 miss).
    classifier = torch.eye(5)
    images = torch.tensor([[0.9, 0.5, 0.4, 0.3, 0.1]])
    five = zeroshot_metrics(images, torch.tensor([4]), classifier)
    assert five["top1"] == 0.0 and five["top5"] == 1.0


def test_retrieval_recall_counts_a_hit_when_any_caption_is_in_the_top_k():
    # 3 images along the axes; 5 captions: image 0 owns captions 0, 1; image 1 owns 2, 3; image 2 owns 4.
    images = torch.eye(3)
    texts = F.normalize(torch.tensor([
        [1.0, 0.0, 0.0],   # caption 0 → image 0 (right)
        [0.0, 0.0, 1.0],   # caption 1 → image 2 (wrong), then images 0 and 1 tie at 0 → image 0
        [0.0, 1.0, 0.1],   # caption 2 → image 1 (right)
        [0.0, 0.2, 1.0],   # caption 3 → image 2 first, image 1 second
        [1.0, 0.0, 0.5],   # caption 4 → image 0 first, image 2 second
    ]), dim=-1)
    owner = torch.tensor([0, 0, 1, 1, 2])
    m = retrieval_metrics(images, texts, owner, ks=(1, 2))
    # text → image: captions 0 and 2 right at 1; at 2 also caption 3 (image 1 second) and caption 4
    # (image 2 second); caption 1 ranks image 2, then image 0 (tie of 0 with image 1 → lower index): hit.
    assert m["text_to_image_R@1"] == pytest.approx(2 / 5)
    assert m["text_to_image_R@2"] == pytest.approx(5 / 5)
    # image → text: image 0's best caption is 0 or 4 (both score 1 vs 0.89): caption 0 (its own) wins
    # → hit. Image 1's best is caption 2 (0.995) → hit. Image 2's best is caption 1 (1.0), not its own
    # caption 4; its second is caption 3 (0.98) — still not 4 → miss at 1 and 2.
    assert m["image_to_text_R@1"] == pytest.approx(2 / 3)
    assert m["image_to_text_R@2"] == pytest.approx(2 / 3)


def test_retrieval_without_captions_says_so():
    # Not a torch.cat traceback: the suite skips such a benchmark before it gets here.
    with pytest.raises(ValueError, match="2 images and 0 captions"):
        retrieval_metrics(torch.eye(2), torch.empty(0, 2), torch.empty(0, dtype=torch.long))


def test_zeroshot_metrics_score_images_against_the_classifier_columns():
    # Every other test uses an identity classifier, which hides a transposed product or a wrong axis.
    # Here D = 3, C = 5: column j is class j's direction; the scores are worked out by hand.
    classifier = F.normalize(torch.tensor([[1., 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1]]), dim=-1).T
    images = F.normalize(torch.tensor([
        [1., 0, 0],    # scores (1, 0, 0, .71, 0)      → class 0; label 0: hit
        [1., 1, 0],    # scores (.71, .71, 0, 1, .5)   → class 3; label 3: hit
        [0., 1, 1],    # scores (0, .71, .71, .5, 1)   → class 4; label 1: miss
        [0., 0, 1],    # scores (0, 0, 1, 0, .71)      → class 2; label 4: miss
        [1., 0, .1],   # scores (.995, 0, .1, .70, .07) → class 0; label 0: hit
    ]), dim=-1)
    labels = torch.tensor([0, 3, 1, 4, 0])
    metrics = zeroshot_metrics(images, labels, classifier)
    # top-1: 3 of 5; recalls: class 0 2/2, class 3 1/1, class 1 0/1, class 4 0/1 → 1/2; 5 classes: top-5 is 1.
    assert metrics == pytest.approx({"top1": 0.6, "mean_per_class_recall": 0.5, "top5": 1.0})
