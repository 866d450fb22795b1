"""Import-only stand-in for torchvision, on the SGLang CPU server's PYTHONPATH only.

PyPI's torchvision wheel is CUDA-linked (``import torchvision`` fails on the CPU torch build with
"operator torchvision::nms does not exist"), yet SGLang's config registry and transformers' image
utilities import a few torchvision names at module level. This text-only server never calls them:
the enums below are real values, and any other name resolves to a function that raises if called.
"""
import enum

__version__ = "0.0.0+megadiv.standin"  # parsed by transformers' version checks: older than any real release


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


def unavailable(module: str):
    """Module ``__getattr__``: every other name is a callable that explains why it cannot run."""
    def getattr_(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def missing(*args, **kwargs):
            raise NotImplementedError(f"{module}.{name} is not available: megadiv's SGLang CPU tier is "
                                      "text-only and ships an import-only torchvision stand-in")
        return missing
    return getattr_
