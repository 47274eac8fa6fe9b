"""Registers the sidecar's optional YAML sections with exporter.config (imported by
parse_config, so that every way of loading settings knows them)."""

from __future__ import annotations

from exporter.admin.config import parse_admin_section
from exporter.policy.config import parse_policy_section
from exporter.sidecar.config import EXTRA_SECTIONS
from exporter.sidecar.reload import parse_reload_section

EXTRA_SECTIONS.setdefault("policy", parse_policy_section)
EXTRA_SECTIONS.setdefault("admin", parse_admin_section)
EXTRA_SECTIONS.setdefault("reload", parse_reload_section)
