"""Data: writing webdataset shards, reading them back as training and eval batches, and the feature
cache's format.

- Shards on disk: their layout and metadata files (`shards`), reading tars and counting what is bad
  in them (`tar_reading`), one sample's fields and how each decodes (`samples`).
- Writing shards: from image folders and tables (`writers`, its options `write_options`; what a
  folder or table holds: `listing`, `folders`, `tables`, `table_classes`, `imagenet_folders`), a
  listed candidate turned into a sample (`sample_encoding`), captions from class names
  (`captions`), Fashion-MNIST (`fashion_mnist`).
- Images and pixels: decoding and re-encoding image files (`images`), preprocessing and batch
  augmentation (`transforms`), JPEGs decoded on the GPU (`gpu_jpeg`).
- Reading for training: the streaming loader (`pipelines`, each worker's stream `shard_stream`),
  whole shards batch by batch for embed (`shard_batches`), a class split read whole and held in
  memory (`class_split`), pretraining's class batches (`class_batches`), batches put on the device
  ahead of use (`device_prefetch`).
- The feature cache's format (`feature_cache`).

Import the module you need (`from lit_softmoe.data.pipelines import create_shard_loader`): this
package imports nothing itself, so loading a model never pulls in webdataset.
"""
