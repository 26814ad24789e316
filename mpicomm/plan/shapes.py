"""Parameter shapes of the models ``mpicomm plan --model`` knows, as the flat model's layers would hold them.

The byte formulas of some methods depend on the layer sizes (Moniqua's per-tensor slots, HSQ's raw small
layers, PowerSGD's matrices), so the planner works on a list of :class:`~mpicomm.flat.Layer`. The shapes
are written out here (no model is built):

* ``resnet20``: the apps' CIFAR ResNet-20 (option A shortcuts, BatchNorm, 10 classes, 3 input channels);
* ``resnet50``: torchvision's ImageNet ResNet-50 (1,000 classes);
* ``bert-base`` / ``bert-large``: the apps' ``BertForMaskedLM`` presets (vocabulary 30,522, 512 positions,
  the decoder's weight tied to the word embeddings, so counted once).

With only a parameter count (``--params N``) the model is taken as square 1024 x 1024 matrices and one
vector for the rest: a stand-in that states its assumption (:func:`layers_from_params`).
"""

from __future__ import annotations

from ..layer import Layer

__all__ = ["MAX_PARAMS", "MODELS", "cifar_resnet", "layers_for_model", "layers_from_params", "layers_of", "numel"]


def _conv_bn(shapes: list, cout: int, cin: int, k: int) -> None:
    shapes += [(cout, cin, k, k), (cout,), (cout,)]


def cifar_resnet(depth: int, in_channels: int = 3, classes: int = 10) -> list[tuple[int, ...]]:
    """Shapes of the apps' CIFAR ResNet-``depth`` (6n+2 layers, 16-32-64 channels, option A shortcuts)."""
    shapes: list = []
    _conv_bn(shapes, 16, in_channels, 3)
    cin = 16
    for cout in (16, 32, 64):
        for _ in range((depth - 2) // 6):
            _conv_bn(shapes, cout, cin, 3)
            _conv_bn(shapes, cout, cout, 3)
            cin = cout
    return shapes + [(classes, 64), (classes,)]


def _resnet50() -> list[tuple[int, ...]]:
    shapes: list = []
    _conv_bn(shapes, 64, 3, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for i in range(blocks):
            _conv_bn(shapes, width, cin, 1)
            _conv_bn(shapes, width, width, 3)
            _conv_bn(shapes, 4 * width, width, 1)
            if i == 0:
                _conv_bn(shapes, 4 * width, cin, 1)
            cin = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def _bert(layers: int, hidden: int, intermediate: int, vocab: int = 30522, positions: int = 512) -> list:
    shapes: list = [(vocab, hidden), (positions, hidden), (2, hidden), (hidden,), (hidden,)]
    for _ in range(layers):
        for _ in range(4):  # query, key, value, attention output
            shapes += [(hidden, hidden), (hidden,)]
        shapes += [(hidden,), (hidden,), (intermediate, hidden), (intermediate,), (hidden, intermediate), (hidden,),
                   (hidden,), (hidden,)]
    return shapes + [(vocab,), (hidden, hidden), (hidden,), (hidden,), (hidden,)]  # MLM head (decoder tied)


MODELS = {
    "resnet20": lambda: cifar_resnet(20),
    "resnet50": _resnet50,
    "bert-base": lambda: _bert(12, 768, 3072),
    "bert-large": lambda: _bert(24, 1024, 4096),
}
"""Model name -> a function returning its parameter shapes, in the model's order."""


def layers_of(shapes) -> list[Layer]:
    """:class:`~mpicomm.flat.Layer` objects for ``shapes``, laid out one after another."""
    out, offset = [], 0
    for i, shape in enumerate(shapes):
        layer = Layer(f"p{i}", offset, tuple(shape))
        out.append(layer)
        offset += layer.numel
    return out


def layers_for_model(name: str) -> list[Layer]:
    """The layers of known model ``name`` (``ValueError`` naming the choices otherwise)."""
    if name not in MODELS:
        raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {name!r}")
    return layers_of(MODELS[name]())


MAX_PARAMS = 2 * 10**11
"""The largest ``--params`` (200 billion, past GPT-3's 175): the stand-in holds one matrix per 2^20 parameters
and the plan's time and memory grow with their count (at this bound 6 CPU-seconds and 0.4 GB, measured)."""


def layers_from_params(params: int) -> list[Layer]:
    """A stand-in model of ``params`` parameters: 1024 x 1024 matrices, then one vector of the rest."""
    if isinstance(params, bool) or not isinstance(params, int) or not 1 <= params <= MAX_PARAMS:
        raise ValueError(f"--params must be an integer in 1..{MAX_PARAMS:,}, got {params!r}")
    full, rest = divmod(params, 1024 * 1024)
    return layers_of([(1024, 1024)] * full + ([(rest,)] if rest else []))


def numel(layers) -> int:
    """Total parameters of ``layers``."""
    return sum(layer.numel for layer in layers)
