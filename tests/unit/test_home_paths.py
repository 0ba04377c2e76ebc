"""Paths as people type them: `key=~/x` names the home folder, as the shell does for `--flag ~/x` (the shell leaves a
`~` after `key=` alone, and Hydra's grammar refuses it)."""

from __future__ import annotations

from pathlib import Path

from shardlab.cli.preflight import with_home_expanded

ROOT = Path(__file__).resolve().parents[2]


def test_a_leading_tilde_of_a_value_or_of_a_sweeps_value_is_the_home_folder(monkeypatch):
    monkeypatch.setenv("HOME", "/home/ada")
    assert with_home_expanded(["model.pretrained=~/models/q", "data.path=~", "-m", "x=~/a,~/b,c~d"]) == [
        "model.pretrained=/home/ada/models/q", "data.path=/home/ada", "-m", "x=/home/ada/a,/home/ada/b,c~d"
    ]  # fmt: skip
    # Hydra's delete override, a user's other home (~bob: the shell's job) and a mid-value ~ are left as written
    assert with_home_expanded(["~model.lora", "data.path=~bob/x", "data.eod_token=a~"]) == [
        "~model.lora", "data.path=~bob/x", "data.eod_token=a~"
    ]  # fmt: skip


def test_the_cli_reads_a_tilde_path_from_home_instead_of_failing_in_hydras_lexer(tmp_path, cli_forks):
    proc = cli_forks.run(
        "model.pretrained=~/models/Qwen2.5-0.5B", "dry_run=true", env={"HOME": str(tmp_path)}, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "LexerNoViableAltException" not in proc.stderr
    assert f"{tmp_path}/models/Qwen2.5-0.5B" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused command wrote nothing"
