"""tools/readme_table.py: the README's demo block made from a report, and the first differing cell named."""

import pytest

from tools import readme_table

REPORT = {
    "metrics": {
        "baseline": {"accuracy": 0.818, "preferred_style_rate": 0.904},
        "policy": {"accuracy": 0.932, "preferred_style_rate": 1.0},
    },
    "comparisons": {
        "baseline": {"accuracy": {"interval": [0.084, 0.144]}, "preferred_style_rate": {"interval": [0.07, 0.12]}}
    },
    "order": ["accuracy", "preferred_style_rate"],
    "win_rates": {
        "baseline": {
            "reward model": {
                "rate": 0.731,
                "interval": [0.71, 0.753],
                "margin": 0.1,
                "wins": 231,
                "ties": 269,
                "losses": 0,
            }
        }
    },
}
MANIFEST = {
    "code_version": "f45f7a0" + "0" * 33,
    "created_at": "2026-12-07T06:00:00+00:00",
    "config": {"seed": 0},
    "versions": {"lock": "dev sha256:abc", "torch": "2.13.0+cpu", "cpu_numerics": "ATEN_CPU_CAPABILITY=avx2"},
}


def test_a_block_made_from_a_report_shows_that_report():
    shown = readme_table.block(REPORT, MANIFEST, on="AMD EPYC, 2 cores")
    assert readme_table.recorded_machine(shown) == "AMD EPYC, 2 cores"
    assert readme_table.recorded_machine(readme_table.block(REPORT, MANIFEST)) == readme_table.machine()
    assert shown.splitlines()[2] == "| metric | baseline (SFT) | policy | change (95% CI) |"
    assert "| accuracy | 0.818 | 0.932 | +0.114 [+0.084, +0.144] |" in shown
    assert "Win rate against the baseline (reward model, ties within 0.1): 0.731 [0.710, 0.753]" in shown
    assert readme_table.recorded_lock(shown) == "dev sha256:abc"
    assert readme_table.first_difference(shown, REPORT) is None


def test_the_first_differing_cell_is_named_by_row_and_column():
    moved = {**REPORT, "metrics": {**REPORT["metrics"], "baseline": {"accuracy": 0.818, "preferred_style_rate": 0.81}}}
    assert readme_table.first_difference(readme_table.block(REPORT, MANIFEST), moved) == (
        "row 'preferred_style_rate', 'baseline (SFT)': the README has '0.904', this run '0.810'"
    )
    fewer = {**REPORT, "order": ["accuracy"]}
    assert "the README has '| preferred_style_rate" in readme_table.first_difference(
        readme_table.block(REPORT, MANIFEST), fewer
    )


def test_write_replaces_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{readme_table.BEGIN}\nold table\n{readme_table.END}\nafter\n")
    readme_table.write(readme, readme_table.block(REPORT, MANIFEST))
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n") and text.endswith(f"{readme_table.END}\nafter\n")
    assert readme_table.first_difference(readme_table.current(text), REPORT) is None
    readme.write_text("# no markers\n")
    with pytest.raises(readme_table.ReadmeTableError, match="no demo-table block"):
        readme_table.write(readme, "x")


def test_the_cli_writes_the_block_from_a_report_folder(tmp_path, capsys):
    import json

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "report.json").write_text(json.dumps(REPORT))
    (tmp_path / "eval" / "manifest.json").write_text(json.dumps(MANIFEST))
    readme = tmp_path / "README.md"
    readme.write_text(f"{readme_table.BEGIN}\n{readme_table.END}\n")
    assert readme_table.main(["--report", str(tmp_path / "eval" / "report.json"), "--readme", str(readme)]) == 0
    assert readme_table.first_difference(readme_table.current(readme.read_text()), REPORT) is None
    assert readme_table.main(["--report", str(tmp_path / "none.json"), "--readme", str(readme)]) == 2
    assert "cannot read the eval report at" in capsys.readouterr().err
