"""Which checkpoint a resume takes when some are corrupt, partial or interrupted (`megarl.checkpoint_layout`), on
checkpoint directories made by hand: fast, no training."""

from __future__ import annotations

import pytest

from megarl.checkpoint_layout import LATEST, find_resume, iter_name, problem, resolve_load, write_manifest
from megarl.errors import ConfigError

pytestmark = pytest.mark.faults


def _ckpt(root, step, manifest=True, latest=True):
    d = root / iter_name(step)
    (d / "__0_0.distcp").parent.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x" * (100 + step))
    (d / "trainer_state.pkl").write_bytes(b"state")
    if manifest:
        write_manifest(d, step)
    if latest:
        (root / LATEST).write_text(d.name + "\n")
    return d


def test_whole_checkpoints_load_and_a_legacy_one_without_manifest_too(tmp_path):
    _ckpt(tmp_path, 1)
    assert resolve_load(str(tmp_path)) == tmp_path / iter_name(1)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    _ckpt(legacy, 5, manifest=False)  # saved before megarl wrote manifests: users' checkpoints still load
    assert problem(legacy / iter_name(5)) == ""
    assert resolve_load(str(legacy)) == legacy / iter_name(5)


def test_a_truncated_file_is_named_and_the_checkpoint_before_it_taken(tmp_path):
    _ckpt(tmp_path, 1)
    bad = _ckpt(tmp_path, 2)
    (bad / "__0_0.distcp").write_bytes(b"x" * 10)  # truncated after the manifest was written
    path, notes = find_resume(tmp_path)
    assert path == tmp_path / iter_name(1)
    assert notes == [f"{iter_name(2)}: corrupt or partial (__0_0.distcp holds 10 bytes, its manifest.json says "
                     "102): skipped, never loaded"]
    (bad / "__0_0.distcp").write_bytes(b"x" * 102)
    (bad / "trainer_state.pkl").unlink()
    assert "trainer_state.pkl, in its manifest.json, is missing" in find_resume(tmp_path)[1][0]
    with pytest.raises(ConfigError, match="corrupt or partial"):
        resolve_load(str(tmp_path), ckpt_step=2)  # asked for by name: an error, never a silent other step


def test_an_interrupted_save_and_a_latest_naming_nothing(tmp_path):
    _ckpt(tmp_path, 3)
    (tmp_path / (iter_name(4) + ".tmp")).mkdir()  # killed while saving step 4: `latest` still names step 3
    path, notes = find_resume(tmp_path)
    assert path == tmp_path / iter_name(3)
    assert notes == [f"{iter_name(4)}.tmp: an interrupted save (killed while saving): skipped, never loaded"]
    (tmp_path / LATEST).write_text(iter_name(9) + "\n")  # names a checkpoint someone deleted
    path, notes = find_resume(tmp_path)
    assert path == tmp_path / iter_name(3) and f"{iter_name(9)}: '{LATEST}' names it, but it does not exist" in notes


def test_no_whole_checkpoint_is_an_error_and_an_empty_directory_a_fresh_start(tmp_path):
    assert resolve_load(str(tmp_path)) is None
    bad = _ckpt(tmp_path, 1)
    (bad / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match=r"no whole checkpoint there:\n  iter_0000001: corrupt or partial"):
        resolve_load(str(tmp_path))


def test_fault_spec_errors_name_the_variable_and_the_faults(monkeypatch):
    from megarl import faults

    monkeypatch.setenv(faults.ENV, "disk_full_on_save@2,slow_node@3:1")
    assert faults.due("disk_full_on_save", 2, rank=0) and faults.due("slow_node", 3, rank=1)
    assert not faults.due("slow_node", 3, rank=0) and not faults.due("disk_full_on_save", 3, rank=0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # restarted workers run unharmed
    assert not faults.due("disk_full_on_save", 2, rank=0)
    monkeypatch.setenv(faults.ENV, "disk_ful@2")
    with pytest.raises(ConfigError, match="MEGARL_FAULT='disk_ful@2'.*trainer_sigkill, kill_during_save"):
        faults.check()


def test_an_unwritable_save_directory_stops_the_run_before_it_starts(tmp_path):
    from megarl.arguments import parse_args
    from megarl.preflight import check_resume

    (tmp_path / "a_file").write_text("not a directory")
    cfg = parse_args([])
    cfg.checkpoint.save = str(tmp_path / "a_file" / "ckpt")  # (root writes anywhere: a file in the way instead)
    with pytest.raises(ConfigError, match=r"--save .*a_file/ckpt: cannot write there \(.*a_file/ckpt: Not a directory"):
        check_resume(cfg, None)
