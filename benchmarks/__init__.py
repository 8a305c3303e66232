"""Benchmarks kept outside the installed package: the jitted step against the PyTorch
reference and the official code (``vs_pytorch``, with ``torch_step``, ``official_step`` and
their shared ``alternating`` timing), the synthetic set's feature probe (``feature_probe``)
and the checkpoint wait (``checkpoint_wait``). Run from the repository root
(``python -m benchmarks.vs_pytorch ...``); they import the library, never the reverse."""
