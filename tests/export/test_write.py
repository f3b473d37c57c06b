"""``write_export``: exactly the file the user named, written atomically, OS errors in one line."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from batchfit.errors import UsageError
from batchfit.export import EXPORT_KINDS, export, render, write_export
from batchfit.hardware import get_gpu
from batchfit.models import resolve_model
from batchfit.plan import Plan, make_plan
from batchfit.spec import TrainingSetup


@pytest.fixture(scope="module")
def zero_plan() -> Plan:
    """A plan whose hf export needs a DeepSpeed config (it used to name ds_config.json)."""
    return make_plan(
        resolve_model("gpt2"),
        get_gpu("a100-40gb"),
        TrainingSetup(num_gpus=2, sharding="zero2"),
        seq_len=512,
        global_batch=32,
    )


@pytest.mark.parametrize("kind", EXPORT_KINDS)
def test_writes_exactly_the_named_file(zero_plan: Plan, kind: str, tmp_path: Path) -> None:
    users = tmp_path / "ds_config.json"
    users.write_text("the user's own file\n", encoding="utf-8")
    out = tmp_path / "train.json"
    assert write_export(zero_plan, kind, out) == {kind: str(out)}
    assert out.read_text(encoding="utf-8") == render(export(zero_plan, kind), kind)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_config.json", "train.json"]
    assert users.read_text(encoding="utf-8") == "the user's own file\n"


def test_replaces_an_existing_file_keeping_its_mode(zero_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    out.write_text("old\n", encoding="utf-8")
    out.chmod(0o640)
    write_export(zero_plan, "hf", out)
    assert out.read_text(encoding="utf-8") == render(export(zero_plan, "hf"), "hf")
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_new_file_gets_the_umask_mode(zero_plan: Plan, tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_export(zero_plan, "deepspeed", tmp_path / "ds.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ds.json").stat().st_mode) == 0o640


def test_a_symlink_is_written_through(zero_plan: Plan, tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    real.write_text("old\n", encoding="utf-8")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert write_export(zero_plan, "hf", link) == {"hf": str(link)}
    assert link.is_symlink()
    assert real.read_text(encoding="utf-8") == render(export(zero_plan, "hf"), "hf")


def test_a_failed_write_leaves_the_old_file_whole(
    zero_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "train.json"
    out.write_text("old\n", encoding="utf-8")

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(UsageError, match=r"train\.json \(out\): No space left on device$"):
        write_export(zero_plan, "hf", out)
    assert out.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["train.json"]  # no temporary left


def test_an_interrupted_write_leaves_nothing_behind(
    zero_plan: Plan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_export(zero_plan, "hf", tmp_path / "train.json")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_in_the_way_is_named(zero_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    out.mkdir()
    message = f"cannot write the export to {out} (out): Is a directory"
    with pytest.raises(UsageError, match=re.escape(message)):
        write_export(zero_plan, "hf", out)
    assert [p.name for p in tmp_path.iterdir()] == ["train.json"]


def test_a_missing_folder_is_named(zero_plan: Plan, tmp_path: Path) -> None:
    out = tmp_path / "nowhere" / "train.json"
    message = f"cannot write the export to {out} (out): No such file or directory"
    with pytest.raises(UsageError, match=re.escape(message)):
        write_export(zero_plan, "hf", out)


def test_a_pipe_is_written_into_not_replaced(zero_plan: Plan, tmp_path: Path) -> None:
    # --out /dev/stdout, /dev/null or a FIFO: a rename would put a regular file in the place of
    # the device or pipe (as root, /dev/null itself)
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(
        target=lambda: got.append(fifo.read_text(encoding="utf-8")), daemon=True
    )
    reader.start()
    assert write_export(zero_plan, "hf", fifo) == {"hf": str(fifo)}
    reader.join(timeout=30)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    assert got == [render(export(zero_plan, "hf"), "hf")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]
