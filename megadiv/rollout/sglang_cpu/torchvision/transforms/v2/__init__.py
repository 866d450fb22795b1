from torchvision import ImageReadMode, InterpolationMode, unavailable  # noqa: F401

__getattr__ = unavailable("torchvision.transforms.v2")
