"""SIGTERM and SIGHUP end a command as Ctrl-C does: its cleanup runs (an export removes its half-written bundle),
one line on stderr, status 128 + the signal, no traceback."""
import os
import signal

import pytest

from specedge.cli import main


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_export_leaves_nothing_behind(tiny_models, tmp_path, capsys, monkeypatch, signum):
    from specedge.export import bundle

    real = bundle._export_model

    def killed_midway(tmp, name, *args, **kwargs):
        real(tmp, name, *args, **kwargs)  # the target's weights and graphs are written by now
        assert os.listdir(tmp_path)  # the hidden temp dir
        os.kill(os.getpid(), signum)
        raise AssertionError("the signal should have ended the export")

    monkeypatch.setattr(bundle, "_export_model", killed_midway)
    before = signal.getsignal(signum)
    status = main(["export", "--target", tiny_models["llama"][0], "--out", str(tmp_path / "b"), "--quiet"])
    assert status == 128 + signum
    assert capsys.readouterr().err.strip() == "terminated"
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(signum) is before  # the command put the process's handler back
