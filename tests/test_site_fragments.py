"""Reading the Hub's site fragments (scalelab.grader.service.site_fragments): only files root alone could have
written, opened without following links, below folders root alone controls. As root (CI runs as root); the Hub's
own refusal is in tests/test_hub.py."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from scalelab.grader.service.site_fragments import UntrustedFragment, trusted_fragments


@pytest.fixture
def hub_d(tmp_path) -> Path:
    if os.geteuid() != 0:
        pytest.fail("the fragments must be root's: run these tests as root (CI does)")
    folder = tmp_path / "etc" / "hub.d"
    folder.mkdir(parents=True)
    return folder


def test_fragments_are_read_in_name_order_and_other_files_left_out(hub_d):
    (hub_d / "50-b.py").write_text("b = 2\n")
    (hub_d / "10-a.py").write_text("a = 1\n")
    (hub_d / "README").write_text("not code\n")
    assert [(path.name, text) for path, text in trusted_fragments(hub_d)] == [("10-a.py", "a = 1\n"),
                                                                              ("50-b.py", "b = 2\n")]
    assert trusted_fragments(hub_d / "absent") == []


def test_a_link_is_never_followed_even_to_a_file_of_roots(hub_d, tmp_path):
    target = tmp_path / "anywhere.py"
    target.write_text("x = 1\n")
    (hub_d / "50-link.py").symlink_to(target)
    with pytest.raises(UntrustedFragment, match="50-link.py cannot be read as a file of root's: a symbolic link"):
        trusted_fragments(hub_d)


def test_a_folder_above_that_another_account_may_write_is_refused(hub_d):
    (hub_d / "50-site.py").write_text("x = 1\n")
    hub_d.parent.chmod(0o777)
    with pytest.raises(UntrustedFragment, match=f"{hub_d.parent} is not root's alone"):
        trusted_fragments(hub_d)
    hub_d.parent.chmod(0o1777)  # sticky, as /tmp: nobody else may rename root's entries there
    assert len(trusted_fragments(hub_d)) == 1


def test_a_linked_folder_is_refused(hub_d, tmp_path):
    (tmp_path / "linked").symlink_to(hub_d)
    with pytest.raises(UntrustedFragment, match="is a symbolic link"):
        trusted_fragments(tmp_path / "linked")


def test_a_fifo_or_a_fragment_of_another_account_is_refused_without_hanging(hub_d):
    os.mkfifo(hub_d / "50-fifo.py")
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_refusal(hub_d)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert outcome and "50-fifo.py is not a regular file" in outcome[0]
    os.unlink(hub_d / "50-fifo.py")
    (hub_d / "50-other.py").write_text("x = 1\n")
    os.chown(hub_d / "50-other.py", 65534, -1)
    assert "50-other.py is not root's alone (owner uid 65534" in _refusal(hub_d)


def _refusal(folder: Path) -> str:
    try:
        trusted_fragments(folder)
    except UntrustedFragment as refusal:
        return str(refusal)
    return "read"
