"""Model builders shared by the apps and ``mpicomm plan --measure``: the CIFAR ResNets (:mod:`.resnet`, plain
torch) and the BERT masked-LM presets (:mod:`.bert`, which needs ``transformers``, the ``apps`` extra, only when
a model is built)."""
