"""``python -m changecap_jax reproduce``: the official PyTorch training (tuyunbin/DIRL,
tuyunbin/SCORER, yaolinli/IDC, imported from the user's checkout) and ours, step by step from
the same weights on the same batches (docs/reproduce.md).

* :mod:`.official` — importing the checkout beside this project, ``.cuda()`` made harmless;
* :mod:`.adapters` — per model: the official files, modules, optimiser, loss terms and hooks;
  :mod:`.idc_pcl` the IDC-PCL one; :mod:`.registry` which model has which;
* :mod:`.run` — inputs, both training steps, the per-step comparison;
* :mod:`.float64` — ``--precision=float64`` on both sides, and its checks;
* :mod:`.evaluate` — ``--evaluate``: both trained models caption a split and are scored;
* :mod:`.report` — the printed table, ``steps.csv`` / ``steps.json`` and ``losses.png``.
"""
