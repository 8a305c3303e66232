"""``python -m changecap_jax COMMAND [--flags]``: every command besides training, by a short name.

Training and evaluation is ``python -m changecap_jax.main``; the others live in ``commands/``
(and ``convert/``) and run from here, each with its own flags (``python -m changecap_jax
COMMAND --help``). Development tools and benchmarks against PyTorch are outside the package
(``tools/``, ``benchmarks/``).
"""

from __future__ import annotations

import runpy
import sys

from changecap_jax.cpu import allocator, platforms

# name -> (module run as __main__, what it does)
COMMANDS = {
    "export": ("changecap_jax.commands.export", "a trained workdir as a self-contained model"),
    "predict": ("changecap_jax.commands.predict", "caption image pairs with an exported model"),
    "report": ("changecap_jax.commands.report", "one HTML page of a run's evaluation"),
    "localize": ("changecap_jax.commands.localize", "where a model looks, against the boxes"),
    "convert": ("changecap_jax.convert.__main__", "an official PyTorch checkpoint as a workdir"),
    "benchmark": ("changecap_jax.commands.benchmark", "time a preset's step, decoding and input"),
    "aot": ("changecap_jax.commands.aot",
            "compile a preset's programs for a TPU slice or GPUs here: memory, roofline"),
    "gpu_check": ("changecap_jax.commands.gpu_check.__main__",
                  "time every model on a GPU host, train and extract there and on the CPU"),
    "benchmark_matching": ("changecap_jax.commands.benchmark_matching",
                           "peak memory of SCORER's matching loss, naive vs chunked"),
    "loader_benchmark": ("changecap_jax.commands.loader_benchmark",
                         "examples/s of the training loader alone"),
    "feed_bench": ("changecap_jax.commands.feed_bench",
                   "steps/s of a preset: streamed, device-prefetched, dataset on the devices"),
    "reproduce": ("changecap_jax.commands.reproduce.__main__",
                  "train side by side with an official checkout"),
    "sweep": ("changecap_jax.commands.sweep", "one training per value of a config field"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    return ("usage: python -m changecap_jax COMMAND [--flags]   (training: python -m "
            f"changecap_jax.main)\ncommands:\n{rows}")


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(usage())
        return 0 if len(argv) >= 2 else 2
    name = argv[1]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    # Before the command's module imports JAX (cli.run would restart it after them).
    platforms.default_to_cpu()
    allocator.restart_with_chosen_allocator()
    sys.argv = [f"changecap_jax {name}", *argv[2:]]
    runpy.run_module(COMMANDS[name][0], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
