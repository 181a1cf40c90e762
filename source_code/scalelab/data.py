"""The course's data sets, one loader each, used by every script, notebook and the grader.

Each loader returns NumPy arrays of raw pixels (uint8) and integer labels, for one split:
``"train"`` (what a student's run may read) or ``"test"`` (the held-out split the grader keeps).
Sources are tried in a fixed order and the first complete one wins; a file that is present but
corrupt or truncated raises :class:`DataError` naming it rather than loading part of it.

This module imports neither TensorFlow nor Horovod, so the grader can use it cheaply.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import numpy as np

SPLITS = ("train", "test")
KERAS_CACHE = Path(os.environ.get("KERAS_HOME", Path.home() / ".keras")) / "datasets"


class DataError(RuntimeError):
    """A data set is missing, corrupt or cannot be fetched; the message says which file and what to do."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")


# --------------------------------------------------------------------------------------------
# Fashion-MNIST
# --------------------------------------------------------------------------------------------

FASHION_MNIST_DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# SHA-256 of the decompressed official files: gzip headers differ between mirrors, the content does not.
FASHION_MNIST_FILES = {
    "train": {
        "images": ("train-images-idx3-ubyte.gz", "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"),
        "labels": ("train-labels-idx1-ubyte.gz", "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    },
    "test": {
        "images": ("t10k-images-idx3-ubyte.gz", "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"),
        "labels": ("t10k-labels-idx1-ubyte.gz", "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
    },
}


def fashion_mnist_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where Fashion-MNIST is looked for, in order: the argument (or else $SCALELAB_FASHION_MNIST_DIR),
    Debian's package, the Keras cache."""
    candidates = [data_dir or os.environ.get("SCALELAB_FASHION_MNIST_DIR"),
                  FASHION_MNIST_DEBIAN_DIR, KERAS_CACHE / "fashion-mnist"]
    return [Path(c) for c in candidates if c]


def fashion_mnist_available(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds all four Fashion-MNIST files (their content is checked when loaded)."""
    names = [name for split in FASHION_MNIST_FILES.values() for name, _ in split.values()]
    return all((Path(directory) / name).is_file() for name in names)


def _read_idx(path: Path, expected_sha256: str | None) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: not a complete gzip file ({error}); delete it and load again") from error
    if expected_sha256 and hashlib.sha256(raw).hexdigest() != expected_sha256:
        raise DataError(f"{path}: content does not match the official Fashion-MNIST file (checksum differs)")
    if len(raw) < 8 or raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise DataError(f"{path}: not an IDX file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    offset = 4 + 4 * ndim
    expected = int(np.prod(shape))
    if len(raw) - offset != expected:
        raise DataError(f"{path}: holds {len(raw) - offset} values, its header announces {expected} (truncated?)")
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(shape)


def _download(url: str, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    partial = destination.with_name(destination.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out)
    except (urllib.error.URLError, OSError) as error:
        partial.unlink(missing_ok=True)
        raise DataError(f"could not download {url}: {error}") from error
    partial.replace(destination)


def load_fashion_mnist(split: str = "train", data_dir: str | os.PathLike | None = None,
                       download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST images (N, 28, 28) uint8 and labels (N,) uint8 for one split."""
    _check_split(split)
    files = FASHION_MNIST_FILES[split]
    for directory in fashion_mnist_dirs(data_dir):
        paths = {kind: directory / name for kind, (name, _) in files.items()}
        if all(p.is_file() for p in paths.values()):
            images = _read_idx(paths["images"], files["images"][1])
            labels = _read_idx(paths["labels"], files["labels"][1])
            return images, labels
    if not download:
        raise DataError(_fashion_mnist_missing_message())
    cache = KERAS_CACHE / "fashion-mnist"
    for name, _ in files.values():
        if not (cache / name).is_file():
            try:
                _download(FASHION_MNIST_URL + name, cache / name)
            except DataError as error:
                raise DataError(f"{error}\n{_fashion_mnist_missing_message()}") from error
    images = _read_idx(cache / files["images"][0], files["images"][1])
    labels = _read_idx(cache / files["labels"][0], files["labels"][1])
    return images, labels


def _fashion_mnist_missing_message() -> str:
    return ("Fashion-MNIST not found. On Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist; "
            "or put the four official *-ubyte.gz files in a directory and set SCALELAB_FASHION_MNIST_DIR to it.")


# --------------------------------------------------------------------------------------------
# CIFAR-10 (the official python format)
# --------------------------------------------------------------------------------------------

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_BATCHES = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}


def _as_cifar10_folder(directory: Path) -> Path:
    """Accept either the cifar-10-batches-py folder itself or the folder that holds it."""
    nested = directory / CIFAR10_FOLDER
    return nested if nested.is_dir() else directory


def cifar10_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where CIFAR-10 is looked for, in order: the argument (or else $SCALELAB_CIFAR10_DIR), the Keras cache."""
    candidates = [data_dir or os.environ.get("SCALELAB_CIFAR10_DIR"), KERAS_CACHE / CIFAR10_FOLDER]
    return [_as_cifar10_folder(Path(c)) for c in candidates if c]


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = pickle.load(f, encoding="bytes")
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError) as error:
        raise DataError(f"{path}: not a complete CIFAR-10 batch ({type(error).__name__}: {error})") from error
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise DataError(f"{path}: not a CIFAR-10 batch (expected the keys b'data' and b'labels')")
    data = np.asarray(batch[b"data"])
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != len(labels):
        raise DataError(f"{path}: expected uint8 data of shape (N, 3072) and N labels, "
                        f"found {data.dtype} {data.shape} and {len(labels)} labels")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels outside 0..9")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return images, labels


def find_cifar10(split: str, data_dir: str | os.PathLike | None = None) -> Path | None:
    """The first configured folder that holds every batch file of ``split``, or None."""
    _check_split(split)
    for folder in cifar10_dirs(data_dir):
        if all((folder / name).is_file() for name in CIFAR10_BATCHES[split]):
            return folder
    return None


def load_cifar10(split: str = "train", data_dir: str | os.PathLike | None = None,
                 download: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """CIFAR-10 images (N, 32, 32, 3) uint8 and labels (N,) int64 for one split.

    Works with the full official set and with any subset in the same format.
    """
    folder = find_cifar10(split, data_dir)
    if folder is None:
        if not download:
            raise DataError(_cifar10_missing_message(split, data_dir))
        folder = _download_cifar10(split, data_dir)
    parts = [_read_cifar_batch(folder / name) for name in CIFAR10_BATCHES[split]]
    images = np.concatenate([p[0] for p in parts])
    labels = np.concatenate([p[1] for p in parts])
    return images, labels


def _cifar10_missing_message(split: str, data_dir) -> str:
    looked = ", ".join(str(p) for p in cifar10_dirs(data_dir))
    needed = ", ".join(CIFAR10_BATCHES[split])
    return (f"CIFAR-10 ({split} split: {needed}) not found in {looked}. "
            f"Download {CIFAR10_URL} (MD5 {CIFAR10_ARCHIVE_MD5}) on a machine with internet access, "
            f"unpack it, and set SCALELAB_CIFAR10_DIR to the folder that holds {CIFAR10_FOLDER}/.")


def _download_cifar10(split: str, data_dir) -> Path:
    archive = KERAS_CACHE / "cifar-10-python.tar.gz"
    if not archive.is_file():
        try:
            _download(CIFAR10_URL, archive)
        except DataError as error:
            raise DataError(f"{error}\n{_cifar10_missing_message(split, data_dir)}") from error
    digest = hashlib.md5()
    with open(archive, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != CIFAR10_ARCHIVE_MD5:
        raise DataError(f"{archive}: MD5 {digest.hexdigest()} is not the official {CIFAR10_ARCHIVE_MD5}; delete it")
    with tempfile.TemporaryDirectory(dir=KERAS_CACHE) as scratch:
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        target = KERAS_CACHE / CIFAR10_FOLDER
        if not target.exists():
            Path(scratch, CIFAR10_FOLDER).replace(target)
    return KERAS_CACHE / CIFAR10_FOLDER


def stage_cifar10_training_split(destination: str | os.PathLike, data_dir=None) -> Path:
    """Copy only the training batches (and the class names) into ``destination``.

    The grader gives a student's run this folder, so the held-out ``test_batch`` is not there to read.
    """
    source = find_cifar10("train", data_dir)
    if source is None:
        raise DataError(_cifar10_missing_message("train", data_dir))
    target = Path(destination) / CIFAR10_FOLDER
    target.mkdir(parents=True, exist_ok=True)
    for name in CIFAR10_BATCHES["train"] + ("batches.meta",):
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return target


# --------------------------------------------------------------------------------------------
# Per-rank sharding
# --------------------------------------------------------------------------------------------

def shard_arrays(images: np.ndarray, labels: np.ndarray, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank`` of ``size`` keeps every size-th example, starting at its rank (disjoint, near-equal shards)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    return images[rank::size], labels[rank::size]


def shard_dataset(dataset, rank: int, size: int):
    """The same partition for a ``tf.data.Dataset``: shard before shuffling and batching."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    return dataset.shard(num_shards=size, index=rank)


LOADERS = {"fashion-mnist": load_fashion_mnist, "cifar10": load_cifar10}


def load(dataset: str, split: str = "train", data_dir=None, download: bool = True):
    """Load a data set by the name the tracks and the grader use (``fashion-mnist`` or ``cifar10``)."""
    try:
        loader = LOADERS[dataset]
    except KeyError:
        raise ValueError(f"unknown data set {dataset!r}; known: {', '.join(LOADERS)}") from None
    return loader(split, data_dir=data_dir, download=download)
