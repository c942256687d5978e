"""Training the project's own tiny models: the embedded default (train_shapes) and the
copy-trained pair behind the speculative-decoding benchmark (train_copy), with their shared loop
(training). Run from the repository root: ``python -m scripts.train.train_shapes``."""
