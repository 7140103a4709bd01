"""The commit a record names: the stamp written before the tree was copied wherever there is one (the
chip host's copy sat in a git repository of its own whose HEAD was an older commit, and before that
inside another project's checkout: both named the wrong commit), else git where the tree is the root
of its own checkout, never an enclosing repository's HEAD."""

import subprocess

from hybridmoe.tools.record import COMMIT_STAMP, commit_of


def _git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _repo(path):
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    _git(path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "x")
    return _git(path, "rev-parse", "HEAD")


def test_own_checkout_names_its_head_and_marks_a_changed_package(tmp_path):
    head = _repo(tmp_path)
    assert commit_of(tmp_path) == head
    # A new record, or any file outside the package, leaves the code the commit's: not "+modified".
    (tmp_path / "benchmarks" / "records").mkdir(parents=True)
    (tmp_path / "benchmarks" / "records" / "new.json").write_text("{}")
    assert commit_of(tmp_path) == head
    (tmp_path / "hybridmoe").mkdir()
    (tmp_path / "hybridmoe" / "x.py").write_text("")
    assert commit_of(tmp_path) == head + "+modified"


def test_a_stamp_wins_over_the_copy_s_own_git(tmp_path):
    """The chip host's copy is the root of a git repository whose HEAD is not the commit sent."""
    head = _repo(tmp_path)
    (tmp_path / "hybridmoe").mkdir()
    (tmp_path / "hybridmoe" / "x.py").write_text("")
    (tmp_path / COMMIT_STAMP).write_text("c" * 40 + "\n")
    assert commit_of(tmp_path) == "c" * 40 != head


def test_a_copy_inside_another_checkout_names_its_stamp_not_that_head(tmp_path):
    outer_head = _repo(tmp_path)
    copy = tmp_path / "work" / "tree"
    (copy / "hybridmoe").mkdir(parents=True)
    stamp = "a" * 40
    (copy / COMMIT_STAMP).write_text(stamp + "\n")
    assert commit_of(copy) == stamp
    (copy / COMMIT_STAMP).unlink()
    assert commit_of(copy) == ""  # unknown, and never outer_head
    assert outer_head != ""


def test_a_copy_outside_any_checkout_names_its_stamp(tmp_path):
    (tmp_path / COMMIT_STAMP).write_text("b" * 40 + "+modified\n")
    assert commit_of(tmp_path) == "b" * 40 + "+modified"


def test_a_new_stamp_names_the_head_now_not_the_stamp_left_from_an_earlier_send(tmp_path):
    """`tpu_records.sh stamp` run again after a commit: the old stamp, read back, named the old commit."""
    from hybridmoe.tools.record import write_commit_stamp
    first = _repo(tmp_path)
    assert write_commit_stamp(tmp_path) == first
    _git(tmp_path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "y")
    second = _git(tmp_path, "rev-parse", "HEAD")
    assert write_commit_stamp(tmp_path) == second != first
    assert (tmp_path / COMMIT_STAMP).read_text().strip() == second


def test_a_stamp_is_refused_on_a_changed_tree_and_the_stamp_there_kept(tmp_path):
    """On the chip host the copy's own git is an older commit, the package changed from it: a stamp
    written there named that commit "+modified" over the one carried from the sending checkout."""
    import pytest

    from hybridmoe.tools.record import write_commit_stamp
    head = _repo(tmp_path)
    (tmp_path / "hybridmoe").mkdir()
    (tmp_path / "hybridmoe" / "x.py").write_text("")
    (tmp_path / COMMIT_STAMP).write_text("c" * 40 + "\n")
    with pytest.raises(ValueError, match=f"{head}\\+modified: a stamp names a committed tree.*the stamp there \\(c{{40}}\\) is kept"):
        write_commit_stamp(tmp_path)
    assert (tmp_path / COMMIT_STAMP).read_text().strip() == "c" * 40
    (tmp_path / COMMIT_STAMP).unlink()
    with pytest.raises(ValueError, match="a stamp names a committed tree"):
        write_commit_stamp(tmp_path)
    assert not (tmp_path / COMMIT_STAMP).exists()
