"""The GPU check: one command that measures what the project does on a GPU host in a few
minutes (``python -m changecap_jax gpu_check --out=DIR``; docs/performance.md "GPU check").

The parent process (``__main__.py``) never imports JAX: it plans the parts, gives each a share
of the time budget and runs every measurement as a child process (``job.py``), so each child
has the device to itself, its peak memory is its own, and one that runs out of memory or time
ends alone. The parts:

* ``steps.py``: every model's train step at its paper preset on random inputs of the paper
  shapes (the benchmark's builders), float32 and bfloat16, and greedy decoding;
* ``training.py``: DIRL+CCR trained on synthetic pairs made in memory (``synthetic_data.py``),
  on the default backend and on the CPU, for the loss curves;
* ``features.py``: ResNet-101 features with CUDA and on the CPU;
* ``report.py``: the JSON and the text table.
"""
