"""The check of an allocator settings string (PYTORCH_CUDA_ALLOC_CONF syntax), made where a
setting is given — the admin API, the policy section of the sidecar's file — so that a typo is
refused there rather than by every agent."""

from __future__ import annotations

from allocator_ext.protocol.service import check_settings_text


def validate_settings(text: str) -> str:
    """`text`, checked by the allocator's own parser; ValueError naming the bad key or value,
    or saying it is longer than an agent accepts, or that a space splits one of its words.

    The sidecar runs without the compiled core (its image has no C++ extension to spare): there
    the string passes unchecked, and each agent still refuses a bad one, changing nothing.
    """
    check_settings_text(text)
    try:
        from allocator_ext import parse_config
    except ImportError:
        return text
    parse_config(text)
    return text
