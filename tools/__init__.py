"""Development tools kept outside the installed package (``changecap_jax/``): the PyTorch
references of every model (``torch_reference/``), the probe of CHEERS' gates
(``cheers_gates``) and the seed tables of sweeps (``seed_table``). Run from the repository
root (``python -m tools.seed_table ...``); they import the library, never the reverse."""
