"""Every on-disk format of peagle: token tables, the feature store, the model cache.

This package imports nothing else of peagle; ``peagle_data`` writes through it and
``peagle_train`` reads through it.
"""

from stores.errors import (
    InputError,
    MissingDependencyError,
    ModelNotFoundError,
    OutputExistsError,
    DiskSpaceError,
    PeagleError,
    StoreFormatError,
    StoreMismatchError,
)

__all__ = [
    "InputError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "OutputExistsError",
    "DiskSpaceError",
    "PeagleError",
    "StoreFormatError",
    "StoreMismatchError",
]
