"""The demo's claims tables on the real pair: a pair folder with `claims_prompts.json` gets tau by context
and by prompt format for both drafters, drawn and rendered (a few of the committed prompts, short)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from required import require_real_pair
from rich.console import Console

from eagle31_export.demo.pair import DRAFTERS, TARGET, EmbeddedPair
from eagle31_export.demo.run import CLAIMS_FILE, _claims

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ROOT / "examples" / "smollm2" / "models"


@pytest.fixture(scope="module", autouse=True)
def _real_pair():  # before the module's other fixtures
    require_real_pair()


@pytest.mark.engine  # minutes: the real pair's reference over five prompt sets, so `make test-quick` leaves it out
def test_the_demo_measures_and_renders_the_pairs_claims_prompts(tmp_path):
    from eagle31_export.cli.demo_cmd import _claims_table

    folder = tmp_path / "pair"
    folder.mkdir()
    for name in (TARGET, *DRAFTERS.values()):
        (folder / name).symlink_to(SMOLLM2 / name)
    committed = json.loads((SMOLLM2 / CLAIMS_FILE).read_text())
    assert sorted(committed["context"]) == ["2048", "512", "8192"] and len(committed["template"]) == 4
    short = {"source": committed["source"], "context": {"512": committed["context"]["512"][:1]},
             "template": {label: prompts[:1] for label, prompts in committed["template"].items()}}
    (folder / CLAIMS_FILE).write_text(json.dumps(short))
    out = tmp_path / "out"
    out.mkdir()

    results = _claims(EmbeddedPair(folder), out)

    assert [r.label for r in results["context"]] == ["512"]
    assert [r.label for r in results["template"]] == list(committed["template"])
    for png in ("tau_by_context.png", "tau_by_template.png"):
        assert (out / png).stat().st_size > 10_000
    written = json.loads((out / "claims.json").read_text())
    assert written["template"][2]["label"] == "long unusual system prompt"
    console = Console(record=True, width=200)
    console.print(_claims_table("prompt format", results["template"]))
    text = console.export_text()
    for row in results["template"]:
        tau = row.tau("EAGLE 3.1", 3).mean
        assert 1.0 <= tau <= 4.0 and f"{tau:.3f} ±" in text
    assert "other chat format (Alpaca)" in text
