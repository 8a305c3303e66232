"""Import official PyTorch checkpoints (SCORER / DIRL snapshots, IDC-PCL state_dicts) into our
orbax checkpoints.

    python -m changecap_jax convert --config=configs/dirl.py:clevr_change \
        --torch_checkpoint=PATH.pt --workdir=DIR [--extra_params=PATH] [--missing=error|init]
    python -m changecap_jax convert --config=configs/idc_pcl.py:finetune/DATASET \
        --torch_checkpoint=PATH.pt --dict_json=dict.json --workdir=DIR

writes ``DIR/checkpoints/<step>`` that ``python -m changecap_jax.main --config=... --workdir=DIR
--mode=eval`` restores. Modules (notes in ``docs/official/``: §1.1, §3.6, §4.5, §6, §7):

* :mod:`.torch_checkpoint` — reading snapshots / state_dicts with torch (optional dependency);
* :mod:`.tables` — key tables (torch key -> Flax path + transform), their checks and conversion;
* :mod:`.model_converter` — :class:`ModelConverter`, what a model's converter provides;
* :mod:`.models` — one converter per model (``dirl``, ``scorer``, ``idc_pcl``);
* :mod:`.registry` — the converters by ``config.model.name`` (docs/converters.md);
* :mod:`.converter` — :func:`convert_checkpoint`, :func:`convert_params`;
* :mod:`.compare` — :func:`forward_outputs`, every intermediate to compare with PyTorch.

Nothing here imports torch until a torch file is read.
"""

from changecap_jax.convert.converter import (
    ConversionReport,
    convert_checkpoint,
    convert_params,
)
from changecap_jax.convert.errors import (
    CheckpointFormatError,
    ConversionError,
    KeyMismatchError,
    TorchUnavailableError,
    WrongModelError,
)

__all__ = [
    "CheckpointFormatError",
    "ConversionError",
    "ConversionReport",
    "KeyMismatchError",
    "TorchUnavailableError",
    "WrongModelError",
    "convert_checkpoint",
    "convert_params",
]
