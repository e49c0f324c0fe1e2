"""What a PASS names as not excluded (parity/blind_spots.py) against what docs/runtimes.md "Measured power"
measured (benchmarks/verdict_power.py's printed table): at every precision and view the table has, each
sabotage that passed some run there is named by the blind spots of that comparison, and each blind spot
names a sabotage the benchmark measures; a half-precision PASS says how to exclude its small systematic
error (fp32), and fp32 with drafts compared catches it in every run the table holds."""

import re
from pathlib import Path

from eagle31_export.parity.blind_spots import blind_spots

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "runtimes.md"
ROW = re.compile(r"^(?P<precision>\S+(?: \S+)*?)\s{2,}(?P<sabotage>\S+(?: \S+)*?)\s+(?P<runs>\d+) \| +(?P<drafts>\d+)/\d+"
                 r" +\S+ +(?P<counts>\d+|-)(?:/\d+)?")
# the words a blind spot uses for each sabotage of the table
NAMED = {"fc x 1.05": "fc scaled by 1.05", "input scale ignored": "global scale 1 instead of 1 / input_scale",
         "taps shifted": "tapped layers shifted", "rope_theta x4": "rope_theta x4"}
GREEDY = {"fp32": (True, False), "bf16": (False, False), "bf16+FP4 act": (False, True), "fp32+FP4 act": (True, True)}


def measured_rows() -> list[dict]:
    """The greedy rows of the one table the section pastes."""
    text = DOCS.read_text().split("### Measured power", 1)[1].split("\n### ", 1)[0]
    table = text.split("```", 2)[1] if "```" in text else ""
    rows = [m.groupdict() for line in table.splitlines() if (m := ROW.match(line))]
    return [r for r in rows if r["precision"] in GREEDY]


def test_every_sabotage_a_run_passed_is_named_where_it_passed():
    rows = measured_rows()
    assert rows, "docs/runtimes.md, Measured power: no table rows read"
    for row in rows:
        if row["sabotage"] == "faithful":
            continue
        exact, fp4 = GREEDY[row["precision"]]
        runs = int(row["runs"])
        for drafts_reported, failed in ((True, row["drafts"]), (False, row["counts"])):
            if failed == "-" or int(failed) == runs:
                continue
            said = " ".join(blind_spots(exact, fp4, drafts_reported))
            assert NAMED.get(row["sabotage"], row["sabotage"]) in said, (row, drafts_reported, said)


def test_every_blind_spot_names_a_measured_sabotage_and_how_fp32_excludes_the_small_one():
    measured = (ROOT / "benchmarks" / "verdict_power.py").read_text()
    sabotages = {s for s in NAMED if f'"{s}"' in measured}
    for exact in (True, False):
        for fp4 in (True, False):
            for drafts in (True, False):
                for spot in blind_spots(exact, fp4, drafts):
                    assert any(words in spot for s, words in NAMED.items() if s in sabotages), spot
    small = [s for s in blind_spots(False, False, True) if NAMED["fc x 1.05"] in s]
    assert small and "serve the same bundle in fp32" in small[0]
    fp32 = [r for r in measured_rows() if (r["precision"], r["sabotage"]) == ("fp32", "fc x 1.05")]
    assert fp32 and all(int(r["drafts"]) == int(r["runs"]) for r in fp32), fp32
