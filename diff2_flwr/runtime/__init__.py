"""The transport-free runtime: the DIFF2 server and worker (plan → replies → release), the
experiment config (YAML → frozen dataclasses), run outputs and checkpoints, shard files, the
in-process driver and the `flwr run` launcher. Imports ``core`` and ``task`` only; Flower glue,
deployment and experiments build on it."""
