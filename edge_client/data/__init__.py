"""Dataset readers a device uses to load its local data: IDX files and class-per-folder images."""

from edge_client.data.idx import (
    FASHION_MNIST_DIR,
    IdxFormatError,
    load_fashion_mnist,
    load_idx_dataset,
    read_idx,
)
from edge_client.data.image_folder import load_image_folder

__all__ = [
    "FASHION_MNIST_DIR",
    "IdxFormatError",
    "load_fashion_mnist",
    "load_idx_dataset",
    "load_image_folder",
    "read_idx",
]
