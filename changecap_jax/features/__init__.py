"""Image features as the models read them: the synthetic grid extractor (``grid``), and the
ResNet-101 grid of the real datasets (``resnet``, ``preprocess``, ``extract``; PyTorch, the
optional extra). ``predict`` uses them on new images; ``data_prep`` on whole datasets."""
