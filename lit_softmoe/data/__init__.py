"""Data: webdataset shards (shards.py), streaming pipelines (pipelines.py), real datasets → shards
(sources.py), preprocessing (transforms.py), tokenizers (tokenizers.py)."""
from lit_softmoe.data.pipelines import (
    SAMPLE_KINDS,
    ShardDataConfig,
    ShardLoader,
    create_shard_loader,
    embedding_caption_sample,
)
from lit_softmoe.data.shards import (
    BadSampleCounter,
    cache_decoded_split,
    iter_class_samples,
    load_class_split,
    num_samples,
    read_classnames,
    shard_urls,
    write_split,
)
from lit_softmoe.data.sources import (
    FASHION_MNIST_CLASSNAMES,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    find_fashion_mnist,
    read_fashion_mnist,
    read_idx,
    write_fashion_mnist_shards,
)
from lit_softmoe.data.transforms import (
    batch_augment,
    eval_transform,
    match_channels,
    normalize_batch,
    to_l_or_rgb,
    train_transform,
)
from lit_softmoe.data.tokenizers import HFTokenizer, OpenClipBPETokenizer, Tokenizer, create_tokenizer

__all__ = [
    "BadSampleCounter", "cache_decoded_split", "iter_class_samples", "load_class_split", "num_samples",
    "read_classnames", "shard_urls", "write_split",
    "FASHION_MNIST_CLASSNAMES", "FASHION_MNIST_MEAN", "FASHION_MNIST_STD", "find_fashion_mnist",
    "read_fashion_mnist", "read_idx", "write_fashion_mnist_shards",
    "batch_augment", "eval_transform", "match_channels", "normalize_batch", "to_l_or_rgb", "train_transform",
    "SAMPLE_KINDS", "ShardDataConfig", "ShardLoader", "create_shard_loader", "embedding_caption_sample",
    "HFTokenizer", "OpenClipBPETokenizer", "Tokenizer", "create_tokenizer",
]
