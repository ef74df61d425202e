"""Data: webdataset shards (`shards`), streaming loaders (`pipelines`, `shard_stream`), writers of
image folders and tables (`folders`, `tables`, `listing`, `sample_encoding`, `writers`), Fashion-MNIST
(`fashion_mnist`), image decoding and re-encoding (`images`), preprocessing (`transforms`) and the
feature cache's format (`feature_cache`).

Import the module you need (`from lit_softmoe.data.pipelines import create_shard_loader`): this
package imports nothing itself, so loading a model never pulls in webdataset.
"""
