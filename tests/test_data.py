"""The data layer: real files load completely, broken or missing ones fail loudly and name the file."""

from __future__ import annotations

import gzip
import shutil
import urllib.error

import numpy as np
import pytest

from scalelab import data


def test_cifar10_train_and_test_splits_load_separately_from_the_configured_directory(cifar10_dir):
    train_images, train_labels = data.load_cifar10("train", download=False)
    test_images, test_labels = data.load_cifar10("test", download=False)
    assert train_images.shape == (5170, 32, 32, 3) and train_images.dtype == np.uint8
    assert test_images.shape == (1017, 32, 32, 3)
    assert len(train_labels) == 5170 and len(test_labels) == 1017
    assert set(np.unique(train_labels)) == set(range(10))
    # Channels-last pixels are a real picture, not a transposed mess: neighbouring pixels correlate.
    row_difference = np.abs(np.diff(train_images[:100].astype(int), axis=2)).mean()
    assert row_difference < 40


def test_cifar10_accepts_the_batches_folder_or_its_parent(cifar10_dir):
    folder = data.find_cifar10("train", cifar10_dir / "cifar-10-batches-py")
    parent = data.find_cifar10("train", cifar10_dir)
    assert folder == parent == cifar10_dir / "cifar-10-batches-py"


def test_cifar10_missing_offline_says_how_to_stage_it(tmp_path, monkeypatch):
    monkeypatch.delenv("SCALELAB_CIFAR10_DIR", raising=False)
    monkeypatch.setattr(data, "KERAS_CACHE", tmp_path / "cache")
    with pytest.raises(data.DataError, match="SCALELAB_CIFAR10_DIR") as error:
        data.load_cifar10("train", data_dir=tmp_path / "nowhere", download=False)
    assert "c58f30108f718f92721af3b95e74349a" in str(error.value)


def test_cifar10_download_failure_offline_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("SCALELAB_CIFAR10_DIR", raising=False)
    monkeypatch.setattr(data, "KERAS_CACHE", tmp_path / "cache")

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setattr(data.urllib.request, "urlopen", offline)
    with pytest.raises(data.DataError, match="could not download .*cifar-10-python.tar.gz"):
        data.load_cifar10("test", data_dir=tmp_path / "nowhere")
    assert not list((tmp_path / "cache").glob("*.part")), "a failed download must not leave partial files"


def test_cifar10_download_with_wrong_md5_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SCALELAB_CIFAR10_DIR", raising=False)
    monkeypatch.setattr(data, "KERAS_CACHE", tmp_path)
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"not the archive")
    with pytest.raises(data.DataError, match="MD5"):
        data.load_cifar10("train", data_dir=tmp_path / "nowhere")


def test_truncated_cifar10_batch_is_an_error_naming_the_file(cifar10_dir, tmp_path):
    broken = tmp_path / "cifar-10-batches-py"
    shutil.copytree(cifar10_dir / "cifar-10-batches-py", broken)
    victim = broken / "data_batch_3"
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(data.DataError, match="data_batch_3"):
        data.load_cifar10("train", data_dir=broken, download=False)


def test_staged_training_split_has_no_heldout_batch(cifar10_dir, tmp_path):
    staged = data.stage_cifar10_training_split(tmp_path / "job", data_dir=cifar10_dir)
    assert sorted(p.name for p in staged.iterdir()) == ["batches.meta"] + [f"data_batch_{i}" for i in range(1, 6)]
    images, _ = data.load_cifar10("train", data_dir=tmp_path / "job", download=False)
    assert len(images) == 5170
    with pytest.raises(data.DataError):
        data.load_cifar10("test", data_dir=staged, download=False)


def test_fashion_mnist_loads_the_debian_files_completely():
    train_images, train_labels = data.load_fashion_mnist("train", download=False)
    test_images, test_labels = data.load_fashion_mnist("test", download=False)
    assert train_images.shape == (60000, 28, 28) and test_images.shape == (10000, 28, 28)
    assert np.bincount(train_labels).tolist() == [6000] * 10
    assert np.bincount(test_labels).tolist() == [1000] * 10


def _copy_fashion_mnist(destination):
    destination.mkdir()
    for split in data.FASHION_MNIST_FILES.values():
        for name, _ in split.values():
            shutil.copyfile(data.FASHION_MNIST_DEBIAN_DIR / name, destination / name)
    return destination


def test_truncated_fashion_mnist_file_is_an_error_naming_it(tmp_path):
    folder = _copy_fashion_mnist(tmp_path / "fashion")
    victim = folder / "t10k-images-idx3-ubyte.gz"
    victim.write_bytes(victim.read_bytes()[:5000])
    with pytest.raises(data.DataError, match="t10k-images-idx3-ubyte.gz"):
        data.load_fashion_mnist("test", data_dir=folder, download=False)


def test_altered_fashion_mnist_content_fails_the_checksum(tmp_path):
    folder = _copy_fashion_mnist(tmp_path / "fashion")
    victim = folder / "t10k-labels-idx1-ubyte.gz"
    labels = bytearray(gzip.decompress(victim.read_bytes()))
    labels[-1] = (labels[-1] + 1) % 10
    victim.write_bytes(gzip.compress(bytes(labels)))
    with pytest.raises(data.DataError, match="checksum"):
        data.load_fashion_mnist("test", data_dir=folder, download=False)


def test_load_by_name_rejects_unknown_data_sets_and_splits():
    with pytest.raises(ValueError, match="known: fashion-mnist, cifar10"):
        data.load("mnist")
    with pytest.raises(ValueError, match="split"):
        data.load("fashion-mnist", "validation")


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_are_disjoint_near_equal_and_cover_everything(size):
    images = np.arange(10)
    labels = np.arange(10) * 10
    shards = [data.shard_arrays(images, labels, rank, size) for rank in range(size)]
    together = np.sort(np.concatenate([s[0] for s in shards]))
    assert together.tolist() == list(range(10))
    assert max(len(s[0]) for s in shards) - min(len(s[0]) for s in shards) <= 1
    assert all((s[1] == s[0] * 10).all() for s in shards), "images and labels must stay paired"
    with pytest.raises(ValueError):
        data.shard_arrays(images, labels, size, size)
