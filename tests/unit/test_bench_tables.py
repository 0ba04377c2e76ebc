"""shardlab_bench/tables.py and shardlab_bench/provenance.py: the measured tables in docs/ are what their JSON renders,
and each says which commit, date, machine and command its figures come from."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardlab_bench import provenance
from shardlab_bench import tables as bench_tables

REPO = Path(__file__).resolve().parents[2]


def test_the_committed_docs_hold_exactly_what_their_json_renders():
    stale = bench_tables.render(REPO, check=True)
    assert stale == [], f"tables out of date in {[str(p) for p in stale]}: run python -m shardlab_bench tables"
    used = set(bench_tables.tables(REPO))
    assert used == set(bench_tables.RENDERERS), f"no table in docs/ uses {set(bench_tables.RENDERERS) - used}"


def test_meta_records_the_commit_machine_and_command():
    argv = ["model=gpt_small", "--out", "x.json"]
    meta = provenance.finish(provenance.collect(str(REPO / "shardlab_bench" / "train.py"), argv))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert meta["commit"] == head
    assert all(not (p.startswith("docs/") or p.endswith(".md")) for p in meta["dirty"])
    assert meta["argv"] == ["train", "model=gpt_small", "--out", "x.json"]
    assert meta["command"] == "python -m shardlab_bench train model=gpt_small --out x.json"
    assert meta["machine"]["cores"] >= 1 and meta["machine"]["cpu"]
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    assert meta["machine"]["cpu_isa"] is None or meta["machine"]["cpu_isa"] in flags.split()
    assert ("avx512f" in flags.split()) == (meta["machine"]["cpu_isa"] == "avx512f")
    assert meta["load_average_at_end"] >= 0 and "_started" not in meta


def bench_json(tokens_per_s: float, backend: str, meta: dict) -> dict:
    """The keys of shardlab_bench/train.py's JSON that the throughput table reads."""
    return {
        "tool": "bench",
        "overrides": ["model=gpt_small", f"distributed.backend={backend}", "distributed.world_size=2"],
        "backend": backend,
        "world_size": 2,
        "num_params": 25_300_000,
        "batch_size": 32,
        "unit": "tokens",
        "tokens_per_step": 4096,
        "steps": 6,
        "warmup": 2,
        "tokens_per_s": tokens_per_s,
        "median_step_ms": 4096 / tokens_per_s * 1000,
        "optimizer_step_ms": 49.04,
        "mfu": 0.057,
        "per_rank": [{"peak_memory_bytes": 1.59 * 2**30, "state_bytes": 0.4 * 2**30}] * 2,
        "meta": meta,
    }


def test_a_table_is_rendered_from_its_json_between_its_markers(tmp_path):
    meta = provenance.finish(
        provenance.collect(str(REPO / "shardlab_bench" / "train.py"), ["model=gpt_small", "--out", "a"])
    )
    meta["load_average_at_start"] = 8.0 * meta["machine"]["cores"]
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    for name, figure, backend in (("a_ddp", 909.4, "ddp"), ("b_fs", 450.0, "fully_sharded")):
        (tmp_path / "docs" / "bench" / f"{name}.json").write_text(json.dumps(bench_json(figure, backend, meta)))
    doc = tmp_path / "docs" / "benchmarks.md"
    doc.write_text(
        "# Benchmarks\n\nbefore\n<!-- bench-table throughput: docs/bench/*.json -->\n| old | 31337.5 |\n"
        "<!-- /bench-table -->\nafter\n"
    )
    assert bench_tables.render(tmp_path, check=True) == [doc]  # stale: it holds a typed figure
    bench_tables.render(tmp_path)
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n<!-- bench-table throughput: docs/bench/*.json -->\n")
    assert text.endswith("<!-- /bench-table -->\nafter\n")
    assert "31337.5" not in text  # (a bare 512 would also match avx512f, or a commit hash)
    assert "| ddp | 909 | 4.50 s | 49.0 ms | 1.59 GiB | 0.40 GiB | 5.7% |" in text
    assert "| fully_sharded | 450 | 9.10 s |" in text
    assert f"commit `{meta['commit'][:10]}`" in text
    assert meta["date"].replace("T", " ").replace("+00:00", " UTC") in text
    assert f"{meta['machine']['cpu']} ({meta['machine']['cores']} cores" in text
    assert meta["machine"]["cpu_isa"] is None or f"cores, {meta['machine']['cpu_isa']}, " in text
    assert "`python -m shardlab_bench train model=gpt_small --out a`" in text
    assert "a loaded machine" in text
    assert "python -m shardlab_bench tables --rerun throughput" in text
    assert bench_tables.render(tmp_path, check=True) == []  # rendering again changes nothing


FAKE_COLLECTIVES = """
import json, sys
from shardlab_bench.provenance import collect, finish

out = sys.argv[sys.argv.index("--out") + 1]
try:
    previous = json.load(open(out))["rows"][0]["all_reduce_ms"]
except FileNotFoundError:
    previous = 0.0
row = {"world_size": 2, "numel": 10**6, "dtype": "float32", "all_reduce_ms": previous + 1.0,
       "reduce_scatter_native_ms": 3.0, "reduce_scatter_via_all_reduce_ms": 2.0, "all_gather_native_ms": 1.5,
       "reduce_scatter_speedup_via_all_reduce": 1.5}
json.dump({"rows": [row], "meta": finish(collect("collectives.py", sys.argv[1:]))}, open(out, "w"))
"""


def test_rerun_runs_the_recorded_command_again_and_renders_its_new_figures(tmp_path, monkeypatch):
    """The recorded command wrote a scratch file that was copied into docs/ afterwards: the rerun writes the docs'
    file itself, through the runner (here a stand-in for the collectives benchmark, which would take a minute)."""
    fake = tmp_path / "fake_collectives.py"
    fake.write_text(FAKE_COLLECTIVES)
    ran = []

    def runner(name, *args):
        ran.append(name)
        return [sys.executable, str(fake), *args]

    monkeypatch.setattr(bench_tables, "command", runner)
    (tmp_path / "docs").mkdir()
    env = bench_tables.child_env()
    subprocess.run([sys.executable, str(fake), "--out", "scratch.json"], cwd=tmp_path, check=True, env=env)
    (tmp_path / "scratch.json").rename(tmp_path / "docs" / "c.json")
    meta = json.loads((tmp_path / "docs" / "c.json").read_text())["meta"]
    assert meta["command"] == "python -m shardlab_bench collectives --out scratch.json"
    doc = tmp_path / "docs" / "c.md"
    doc.write_text("<!-- bench-table collectives: docs/c.json -->\n<!-- /bench-table -->\n")
    bench_tables.render(tmp_path)
    assert "| 2 | 1M (float32) | 1.0 ms |" in doc.read_text()

    assert bench_tables.main(["--rerun", "collectives"], root=tmp_path) == 0
    assert ran == ["collectives"]
    assert "| 2 | 1M (float32) | 2.0 ms |" in doc.read_text()
    assert not (tmp_path / "scratch.json").exists()


def test_the_runner_reruns_a_benchmark_by_its_name_and_a_user_commands_script_by_its_path():
    assert bench_tables.recorded_command(REPO, ["plan_moe", "--out", "x.json"]) == [
        sys.executable, "-m", "shardlab_bench", "plan_moe", "--out", "x.json"
    ]  # fmt: skip
    evaluate = bench_tables.recorded_command(REPO, ["tools/evaluate.py", "runs/x", "--out", "y.json"])
    assert evaluate == [sys.executable, str(REPO / "tools" / "evaluate.py"), "runs/x", "--out", "y.json"]
    for data in (["provenance"], ["tables/../train"], ["tools/../shardlab_bench/train.py"], ["-c", "print(1)"], []):
        assert bench_tables.recorded_command(REPO, data) is None, data


def test_rerun_runs_only_a_tool_of_the_repository(tmp_path):
    """A JSON file is data: one whose recorded command is not a tools/ script (python -c ...) is refused unrun."""
    (tmp_path / "docs").mkdir()
    marker = tmp_path / "code-ran"
    meta = {
        "command": "python -m shardlab_bench collectives",
        "argv": ["-c", f"open({str(marker)!r}, 'w')"],
        "cwd": ".",
    }
    (tmp_path / "docs" / "c.json").write_text(json.dumps({"rows": [], "meta": meta}))
    (tmp_path / "docs" / "c.md").write_text("<!-- bench-table collectives: docs/c.json -->\n<!-- /bench-table -->\n")
    with pytest.raises(SystemExit, match="records no benchmark to rerun"):
        bench_tables.main(["--rerun", "collectives"], root=tmp_path)
    assert not marker.exists()


def test_the_runner_lists_every_benchmark_and_refuses_an_unknown_one_in_one_line(tmp_path):
    """``python -m shardlab_bench`` from another folder (a benchmark's child runs wherever its parent put it): the list
    names each module with a main and no helper; an unknown name is one line and exit code 2."""
    import shardlab_bench

    modules = {p.stem for p in (REPO / "shardlab_bench").glob("*.py") if not p.stem.startswith("_")}
    assert set(shardlab_bench.benchmarks()) == modules - set(shardlab_bench.HELPERS)
    assert {"train", "reference", "tables", "plan_moe", "max_model"} <= set(shardlab_bench.benchmarks())
    env = shardlab_bench.child_env()
    listing = subprocess.run(shardlab_bench.command(), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert listing.returncode == 0
    assert all(f"\n  {name} " in listing.stdout for name in shardlab_bench.benchmarks()), listing.stdout
    unknown = subprocess.run(shardlab_bench.command("trian"), cwd=tmp_path, env=env, capture_output=True, text=True)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "no benchmark named 'trian'; known: activation_checkpointing" in unknown.stderr
    usage = subprocess.run(shardlab_bench.command("plan_moe", "--help"), cwd=tmp_path, env=env, capture_output=True,
                           text=True, check=True)  # fmt: skip
    assert usage.stdout.startswith("usage: python -m shardlab_bench plan_moe ")
