"""NCCL's buffer registration through the allocator's trace hooks
(TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1) where allocwatch's allocator cannot serve it
safely: PyTorch switches the hook off only under its own expandable segments, so install()
switches it off, with a warning that says why, under allocwatch's paged segments and on the
pluggable path (docs/torch.md, "NCCL buffer registration"). install() itself needs a CUDA build
of torch; here the decision it acts on is checked alone."""

from __future__ import annotations

import pytest

from allocator_ext.torch_integration import NCCL_REGISTER_HOOK, nccl_registration_conflict


@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_paged_segments_switch_the_hook_off_saying_why(value: str) -> None:
    reason = nccl_registration_conflict({NCCL_REGISTER_HOOK: value}, native=True, paged=True)
    assert reason is not None and "paged segments" in reason


def test_the_pluggable_path_switches_it_off_whatever_the_segments() -> None:
    for paged in (True, False):
        reason = nccl_registration_conflict({NCCL_REGISTER_HOOK: "1"}, native=False, paged=paged)
        assert reason is not None and "pluggable path" in reason


def test_plain_segments_through_the_native_back_end_keep_the_hook() -> None:
    assert nccl_registration_conflict({NCCL_REGISTER_HOOK: "1"}, native=True,
                                      paged=False) is None


@pytest.mark.parametrize("value", [None, "", "0", "false", "off"])
def test_nothing_is_switched_where_the_hook_was_not_asked_for(value: str | None) -> None:
    environ = {} if value is None else {NCCL_REGISTER_HOOK: value}
    assert nccl_registration_conflict(environ, native=False, paged=True) is None
