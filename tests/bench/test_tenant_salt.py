"""``carryover bench tenant-salt`` end to end on simulated engines: salted tenants each
compute the shared system prompt once, shared-cache tenants once in all (P's counters)."""

from __future__ import annotations

import json
from pathlib import Path

from carryover.bench.tenant_salt import run_tenant_salt


def test_salted_tenants_each_compute_the_shared_prompt_once(tmp_path: Path) -> None:
    report = run_tenant_salt(tmp_path, tenants=3, per_tenant=2, system_tokens=400)
    salted, shared = report["arms"]["salted"], report["arms"]["shared"]
    assert salted["turns"] == shared["turns"] == 6
    # Three tenants compute the system prompt three times against once: about 2 x 400 more.
    assert salted["p_computed"] - shared["p_computed"] >= 2 * 400 - 2 * 128
    assert json.loads((tmp_path / "tenant_salt.json").read_text())["tenants"] == 3
