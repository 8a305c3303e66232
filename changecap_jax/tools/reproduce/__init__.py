"""``python -m changecap_jax reproduce``: the official PyTorch training (tuyunbin/DIRL,
tuyunbin/SCORER, imported from the user's checkout) and ours, step by step from the same
weights on the same batches (docs/reproduce.md).

* :mod:`.official` — importing the checkout beside this project, ``.cuda()`` made harmless;
* :mod:`.adapters` — per model: the official files, modules, loss terms and after-step hook;
* :mod:`.run` — inputs, both training steps, the per-step comparison;
* :mod:`.float64` — ``--precision=float64`` on both sides, and its checks;
* :mod:`.report` — the printed table, ``steps.csv`` / ``steps.json`` and ``losses.png``.
"""
