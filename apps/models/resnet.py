"""The ResNet app's models: the library's CIFAR ResNets (:mod:`mpicomm.models.resnet`), which ``mpicomm plan
--measure`` times too."""

from mpicomm.models.resnet import MODELS, CifarResNet, ResNet18, build_model, check_model

__all__ = ["MODELS", "CifarResNet", "ResNet18", "build_model", "check_model"]
