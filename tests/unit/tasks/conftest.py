"""Fixtures the vision-language tests of several areas share (tests/unit/tasks/common/nn, tests/unit/tasks/rl): the
demo VLM saved once per test module, on each family (`vlm_folder`) or on Qwen2-VL alone (`qwen_vlm_folder`)."""

import pytest

from tasks.data import demo_vlm

from tests.vlm_demo import saved_demo


@pytest.fixture(scope="module", params=demo_vlm.FAMILIES)
def vlm_folder(request, tmp_path_factory):
    return saved_demo(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def qwen_vlm_folder(tmp_path_factory):
    return saved_demo(tmp_path_factory, "qwen2_vl")
